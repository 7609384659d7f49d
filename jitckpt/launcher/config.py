"""Command-line flags of `jitckpt run` (torchrun's, plus jitckpt's own) and their validation."""
from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from jitckpt.plugins import LoggingPlugin
from jitckpt.plugins import get as get_plugins
from jitckpt.hang_timeout import HangTimeout

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
# Same names as snapshot_protection.SCHEMES (not imported: the launcher does not import torch).
SNAPSHOT_PROTECTIONS = ("aec", "arc", "none")
SNAPSHOT_ZERO_MODES = ("recompute", "copy", "log")  # worker_spec's, without importing it here either
RECOVERY_MODES = ("jit", "stage", "inprocess")
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default --signals-to-handle
_STD_RE = re.compile(r"^[0-3]$|^\d+:[0-3](,\d+:[0-3])*$")  # torchrun's Std.from_str grammar


def _nnodes(text: str) -> tuple[int, int]:
    """torchrun's ``N`` or ``MIN:MAX``: (min, max) nodes."""
    lo, colon, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi if colon else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nnodes {text}: expected a node count N or a range MIN:MAX") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"--nnodes {text}: expected 1 <= MIN <= MAX")
    return low, high


def _nproc(text: str) -> int:
    """A number, or torchrun's words with torchrun's meaning (its own code): gpu (the visible CUDA
    devices), cpu (the CPU count), auto (the accelerators if any, else the CPU count), xpu."""
    try:
        n = int(text)
    except ValueError:
        from torch.distributed.run import determine_local_world_size

        try:
            n = determine_local_world_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"--nproc-per-node {text}: {e} Give a number, or one of gpu, cpu, xpu, auto (as torchrun)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--nproc-per-node {text} gives {n} workers; it must be >= 1")
    return n


def _check_seconds(flag: str, value: float, *, zero_ok: bool) -> None:
    """A duration flag is a finite number > 0 (>= 0 with ``zero_ok``): inf or nan would silently
    turn off the wait or check it bounds."""
    low_ok = value >= 0 if zero_ok else value > 0
    if not (math.isfinite(value) and low_ok):
        raise ValueError(f"{flag} {value!r}: expected a finite number of seconds "
                         f"{'>= 0' if zero_ok else '> 0'}")


def _seconds(text: str) -> float:
    """argparse type of a duration flag without a LaunchConfig field (accepted for torchrun)."""
    try:
        value = float(text)
        _check_seconds("", value, zero_ok=False)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of seconds > 0") from None
    return value


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port number 0..65535")
    return port


def _hang(text: str) -> str:
    try:
        return HangTimeout.parse(text).to_text()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """torchrun-compatible flags (both dash and underscore spellings) plus jitckpt's own."""
    def both(*names: str, **kw) -> None:
        flags = []
        for n in names:
            flags.append(n)
            if "-" in n[2:]:
                flags.append("--" + n[2:].replace("-", "_"))
        g.add_argument(*flags, **kw)

    g = p.add_argument_group("torchrun's flags (torch.distributed.run), with torchrun's meaning unless said")
    both("--nnodes", type=_nnodes, default=(1, 1),
         help="number of nodes, N or MIN:MAX: with a range a generation starts with the nodes present once MIN "
              "joined and --rdzv-conf last_call_timeout passed (or all MAX joined), so the job goes on with fewer "
              "nodes after a node loss and grows again when a launcher joins")
    both("--nproc-per-node", type=_nproc, default=1,
         help="workers per node: a number, or gpu, cpu, xpu or auto with torchrun's meaning")
    both("--rdzv-backend", default="c10d", choices=["c10d", "static", "etcd", "etcd-v2"],
         help="the job's store with --nnodes > 1: c10d and static are a store node 0's launcher serves at "
              "--rdzv-endpoint (the job ends with node 0); etcd and etcd-v2 are etcd's v2 API at --rdzv-endpoint "
              "(etcd --enable-v2; pip install python-etcd): it outlives any node, and a launcher started with a lost "
              "node's slot and the same --rdzv-id joins the running job in its place")
    both("--rdzv-endpoint", default="", help="host:port of node 0's store (required for nnodes > 1)")
    both("--rdzv-id", default="", help="job id shared by all nodes; its checkpoints go to "
         "<checkpoint-dir>/<id>/ (without an id: <checkpoint-dir>/ itself)")
    both("--rdzv-conf", default="", help="key=value,...: timeout or join_timeout (seconds to wait for the "
         "other nodes at each generation), last_call_timeout (with --nnodes MIN:MAX: seconds to wait for more "
         "nodes once MIN joined; default 30, as torchrun); other keys are refused")
    g.add_argument("--standalone", action="store_true", help="single node, local rendezvous (what one node does anyway)")
    both("--max-restarts", type=int, default=3, help="restarts before giving up (torchrun's default is 0)")
    both("--monitor-interval", type=_seconds, default=0.2,
         help="seconds between the launcher's checks of its workers and reads of their step boards "
              "(it also wakes on every message; steps send none)")
    both("--start-method", default="spawn", choices=["spawn", "fork", "forkserver"],
         help="spawn only: workers are fresh processes (warm standbys); fork and forkserver are refused")
    both("--event-log-handler", default="null",
         help="null only: jitckpt writes its events to <run-dir>/events.jsonl")
    g.add_argument("--role", default="default", help="ROLE_NAME of the workers, and the prefix of --tee lines")
    both("--no-python", action="store_true", help="run the program directly, not with python")
    g.add_argument("-m", "--module", action="store_true", help="run the script as a module")
    both("--run-path", action="store_true",
         help="run the script with runpy.run_path (how jitckpt's workers always run a script)")
    both("--log-dir", default="",
         help="base directory of the workers' log files: <log-dir>/<run id>/attempt_<generation>/<local "
              "rank>/{stdout.log,stderr.log,error.json}, with several nodes <log-dir>/<run id>/node<node "
              "rank>/attempt_... (default <run-dir>/logs)")
    g.add_argument("-r", "--redirects", default="0",
                   help="redirect workers' output to files in the log directory: 0 none, 1 stdout, 2 stderr, "
                        "3 both, or per local rank as 0:1,1:2")
    g.add_argument("-t", "--tee", default="0",
                   help="as --redirects, and also print the lines on this console prefixed [<role><local rank>]:")
    both("--local-ranks-filter", default="",
         help="comma-separated local ranks whose output is shown on the console (files keep everything)")
    both("--duplicate-stdout-filters", default="", help="refused (not supported)")
    both("--duplicate-stderr-filters", default="", help="refused (not supported)")
    both("--node-rank", type=int, default=None,
         help="this node's slot (0..MAX-1); with MIN:MAX a generation's global ranks follow the slots present. "
              "Without it the launchers take free slots, or the slot of a launcher that is gone (c10d: the one that "
              "serves the store at --rdzv-endpoint is node 0; static: 0; default: 0 on one node)")
    both("--master-addr", default="127.0.0.1", help="MASTER_ADDR of the workers (rank 0 serves their store there): "
         "one node, or node 0's address the other nodes reach with --rdzv-backend etcd (with c10d it is node 0's "
         "--rdzv-endpoint host)")
    both("--master-port", type=_port, default=None,
         help="one node: MASTER_PORT of the first generation (a restart takes a free port: the old one may linger)")
    both("--local-addr", default=None,
         help="this node's address the others reach (its workers' store, when it holds the job's lowest rank); "
              "default: --master-addr on node 0, else this host's name (loopback when --master-addr is loopback)")
    both("--logs-specs", default=None, help="refused: --log-dir, --redirects and --tee are built in")
    both("--numa-binding", default=None, choices=["node", "socket", "exclusive", "core-complex"],
         help="refused (not supported)")
    both("--signals-to-handle", default=DEFAULT_SIGNALS,
         help="the default only: SIGTERM and SIGINT are a preemption (the workers save, then exit)")
    both("--shutdown-timeout", type=int, default=None, help="refused: see --save-timeout")
    both("--virtual-local-rank", action="store_true", help="refused (not supported)")
    g = p.add_argument_group("jitckpt")
    g.add_argument("--checkpoint-dir", default="jitckpt-checkpoints", help="where checkpoints go")
    g.add_argument("--run-dir", default="", help="event log and run files (default: <checkpoint-dir>/runs/<run id>)")
    g.add_argument("--hang-timeout", type=_hang, default=None,
                   help="seconds a collective may block, or 'auto[:floor=S,mult=X,startup=S]' (adaptive: "
                        "a multiple of the recent maximum; default auto = floor 30 s, 10x, 120 s at start)")
    g.add_argument("--periodic-every", type=int, default=0,
                   help="also take a periodic checkpoint every N steps (fallback tier; 0 = off)")
    g.add_argument("--save-timeout", type=float, default=120.0,
                   help="seconds to wait for JIT checkpoints after a failure")
    g.add_argument("--warm-standby", type=int, default=1, choices=[0, 1, 2],
                   help="warm standby processes per local rank (0 = start cold)")
    g.add_argument("--status-interval", type=float, default=10.0, help="seconds between status lines (0 = off)")
    g.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    g.add_argument("--metrics-addr", default="127.0.0.1",
                   help="metrics bind address (loopback default; any other needs $JITCKPT_METRICS_TOKEN, "
                        "sent by scrapers as a bearer token)")
    g.add_argument("--preload", default="",
                   help="LD_PRELOAD for the workers; 'libjit' = jitckpt's CUDA/NCCL interposer (GPU hang "
                        "detection), or a path")
    g.add_argument("--transparent", action="store_true",
                   help="proxy mode: every CUDA/NCCL call of each worker runs in a device-proxy process "
                        "(jitckpt-proxy, one per worker, started by libjit.so and ending with it), so the "
                        "worker holds no device state; implies --preload libjit (verified on simcuda)")
    g.add_argument("--recovery", default=None, choices=list(RECOVERY_MODES),
                   help="jit: on a failure save JIT checkpoints from the survivors and restart every "
                        "rank (default); stage: keep the survivors running and start one replacement "
                        "for the dead rank, which replays its inputs from its neighbours' SWIFT logs "
                        "(pipeline stages; the default with --plugin logging; see "
                        "jitckpt.swift.StageMembership); inprocess: the survivors save as with jit but keep "
                        "their processes: each leaves its script, and runs it again in the same process "
                        "with the same rank once a warm standby takes the dead rank's place (docs/recovery.md)")
    g.add_argument("--plugin", default="",
                   help="SWIFT recovery plugins, comma-separated. undo: a failure that tears the "
                        "optimizer step is undone on the survivors: in-process before their JIT save "
                        "(jitckpt.protect's optimizer), and with --transparent in the device proxy before "
                        "the minibatch is replayed (native programs register inverse kernels, "
                        "jitckpt/undo.h). logging: pipeline stages log the messages they send "
                        "(jitckpt.swift.SendLogger) and a dead stage is replaced alone (--recovery stage; "
                        "in-process only)")
    g.add_argument("--snapshot-every", type=int, default=0,
                   help="in-memory snapshot (REFT tier) of jitckpt.protect()'s state every N steps, kept by "
                        "a per-node keeper process that outlives the trainers (0 = off)")
    g.add_argument("--snapshot-protection", default=None, choices=list(SNAPSHOT_PROTECTIONS),
                   help="redundancy across nodes for snapshots: aec (XOR parity), arc (copy on the "
                        "predecessor node), none (default: aec with >= 2 nodes, none on one node)")
    g.add_argument("--snapshot-flush-every", type=int, default=0,
                   help="also write every K-th snapshot to --checkpoint-dir (0 = never)")
    g.add_argument("--snapshot-zero", default="recompute", choices=list(SNAPSHOT_ZERO_MODES),
                   help="how a ZeroRedundancyOptimizer's partitions get a copy on another node: "
                        "recompute (REFT's AOR: each rank redoes its successor's optimizer step every "
                        "step, no traffic; suits hosts with idle cores) or copy (each rank sends its "
                        "partition to its predecessor at every snapshot, no recompute; cheaper when the "
                        "host's cores are busy and snapshots are not taken every step) or log (with "
                        "--snapshot-every 1: copy every --snapshot-zero-copy-every steps and log the "
                        "successor's gradients every step; a lost partition is replayed to the failed "
                        "step). See docs/aor.md")
    g.add_argument("--snapshot-zero-copy-every", type=int, default=20,
                   help="--snapshot-zero log: copy the partitions every K steps (a restore replays up to K "
                        "logged steps; each keeper holds 2K steps of its successor partition's gradients)")
    p.add_argument("script", help="training script (or module with -m, or program with --no-python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)


# torchrun's flags that cannot apply here: (flag, the value that is torchrun's default, why not).
_REFUSED = (
    ("--start-method", ("spawn",), "workers are always fresh processes (warm standbys started with spawn's "
                                   "semantics): fork and forkserver cannot apply"),
    ("--event-log-handler", ("null",), "jitckpt writes its events to <run-dir>/events.jsonl (see `jitckpt report`)"),
    ("--duplicate-stdout-filters", ("",), "not supported"),
    ("--duplicate-stderr-filters", ("",), "not supported"),
    ("--logs-specs", (None,), "only the built-in --log-dir/--redirects/--tee layout is supported"),
    ("--numa-binding", (None,), "not supported"),
    ("--signals-to-handle", (DEFAULT_SIGNALS,), "jitckpt handles SIGTERM and SIGINT as a preemption (the workers "
                                                "save, then exit) and cannot handle another set"),
    ("--shutdown-timeout", (None,), "on a preemption the workers get --save-timeout to save before they are killed"),
    ("--virtual-local-rank", (False,), "not supported"),
)


def refuse_torchrun_flags(a: argparse.Namespace) -> None:
    """A torchrun flag given a value jitckpt cannot honour is refused, naming why (not ignored)."""
    for flag, defaults, why in _REFUSED:
        value = getattr(a, flag[2:].replace("-", "_"))
        if value not in defaults:
            raise ValueError(f"{flag} {value}: {why}")


def _rdzv_conf(conf: str) -> dict[str, float]:
    """--rdzv-conf key=value,...: timeout and join_timeout (torchrun's c10d rendezvous keys) bound the
    wait for the other nodes, last_call_timeout (torchrun's etcd rendezvous key) the wait for more
    nodes than MIN; any other key is refused."""
    out = {"rdzv_timeout": 300.0, "last_call_timeout": 30.0}
    for item in filter(None, (x.strip() for x in conf.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--rdzv-conf {conf!r}: expected key=value pairs separated by commas")
        if key not in ("timeout", "join_timeout", "last_call_timeout"):
            raise ValueError(f"--rdzv-conf {key}: not supported (only timeout and join_timeout, the seconds to wait "
                             "for the other nodes, and last_call_timeout)")
        try:
            seconds = float(value)
            _check_seconds(f"--rdzv-conf {key}", seconds, zero_ok=key == "last_call_timeout")
        except ValueError:
            raise ValueError(f"--rdzv-conf {key}={value}: expected a finite number of seconds > 0") from None
        out["last_call_timeout" if key == "last_call_timeout" else "rdzv_timeout"] = seconds
    return out


def _local_ranks(text: str) -> frozenset:
    if not text:
        return frozenset()
    try:
        ranks = frozenset(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--local-ranks-filter {text!r}: expected comma-separated local ranks, e.g. 0,1,2") from None
    if any(r < 0 for r in ranks):
        raise ValueError(f"--local-ranks-filter {text!r}: local ranks are >= 0")
    return ranks


def check_writable_dir(path: str, flag: str) -> None:
    """Create ``path`` and write a file in it, so an unusable directory is refused at start, not
    at the first failure (when the JIT checkpoints that would save the job go there)."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".jitckpt-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {path}: not a writable directory ({e.strerror or e}); "
                         f"give a directory this user can create files in") from None


@dataclass
class LaunchConfig:
    script: str
    script_args: list = field(default_factory=list)
    nnodes: int = 1            # MAX of --nnodes MIN:MAX
    min_nodes: Optional[int] = None  # MIN (None: nnodes)
    nproc_per_node: int = 1
    node_rank: Optional[int] = None  # None: the rendezvous gives it (NodeCoordinator)
    rdzv_endpoint: str = ""
    rdzv_backend: str = "c10d"
    run_id: str = ""
    max_restarts: int = 3
    module: bool = False
    no_python: bool = False
    checkpoint_dir: str = "jitckpt-checkpoints"
    run_dir: str = ""
    hang_timeout: Optional[str] = None
    periodic_every: int = 0
    save_timeout: float = 120.0
    warm_standby: int = 1
    status_interval: float = 10.0
    metrics_port: Optional[int] = None
    metrics_addr: str = "127.0.0.1"
    preload: str = ""
    transparent: bool = False
    plugins: tuple = ()
    recovery: Optional[str] = None  # None: "stage" with --plugin logging, else "jit"
    snapshot_every: int = 0
    snapshot_protection: Optional[str] = None
    snapshot_flush_every: int = 0
    snapshot_zero: str = "recompute"
    snapshot_zero_copy_every: int = 20
    rdzv_timeout: float = 300.0
    last_call_timeout: float = 30.0
    omp_num_threads: int = 1
    # torchrun's flags with an effect here (see add_run_arguments)
    role: str = "default"
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    local_addr: Optional[str] = None
    monitor_interval: float = 0.2
    log_dir: str = ""
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset = frozenset()

    def __post_init__(self) -> None:
        self.hang_timeout = HangTimeout.parse(self.hang_timeout or "auto").to_text()
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT of node 0 (same on every node)")
        if self.node_rank is None and (self.nnodes == 1 or self.rdzv_backend == "static"):
            self.node_rank = 0
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, {self.nnodes})")
        self.min_nodes = self.nnodes if self.min_nodes is None else self.min_nodes
        if not 1 <= self.min_nodes <= self.nnodes:
            raise ValueError(f"--nnodes {self.min_nodes}:{self.nnodes}: expected 1 <= MIN <= MAX")
        _check_seconds("last_call_timeout", self.last_call_timeout, zero_ok=True)
        if self.max_restarts < 0 or self.periodic_every < 0:
            raise ValueError("--max-restarts and --periodic-every must be >= 0")
        _check_seconds("--save-timeout", self.save_timeout, zero_ok=False)
        _check_seconds("--status-interval", self.status_interval, zero_ok=True)
        _check_seconds("rdzv_timeout", self.rdzv_timeout, zero_ok=False)
        for flag, value in (("--redirects", self.redirects), ("--tee", self.tee)):
            if not _STD_RE.match(value):
                raise ValueError(f"{flag} {value!r}: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per "
                                 "local rank as 0:1,1:2")
        if self.master_port is not None and self.nnodes > 1:
            raise ValueError("--master-port applies to one node; with --nnodes > 1 node 0 picks the workers' port "
                             "and publishes it through --rdzv-endpoint")
        _check_seconds("--monitor-interval", self.monitor_interval, zero_ok=False)
        if self.metrics_port is not None:
            try:  # an optional dependency: refused at the flag, with metrics.py's install hint
                import jitckpt.observability.metrics  # noqa: F401
            except ImportError as e:
                raise ValueError(str(e)) from None
        if self.rdzv_backend in ("etcd", "etcd-v2"):
            try:
                import etcd  # noqa: F401  # type: ignore[import-not-found]
            except ImportError:
                from jitckpt.launcher.job_store import ETCD_INSTALL

                raise ValueError(f"--rdzv-backend {self.rdzv_backend} needs the python-etcd client: {ETCD_INSTALL}") from None
            if not self.rdzv_endpoint:
                raise ValueError(f"--rdzv-backend {self.rdzv_backend} needs --rdzv-endpoint HOST:PORT of etcd")
            from jitckpt.launcher.job_store import etcd_members

            etcd_members(self.rdzv_endpoint)  # ValueError naming a bad entry
        if self.no_python and self.module:
            raise ValueError("--no-python and -m/--module cannot be combined")
        if not self.no_python and not self.module and not os.path.isfile(self.script):
            raise ValueError(f"training script {self.script!r} not found")
        if not self.no_python:  # before any worker starts, not once per restart
            from jitckpt.torch_compat import UntestedTorchError, installed_torch, require_supported_torch

            version = installed_torch()
            try:
                if version is not None:
                    require_supported_torch(version)
            except UntestedTorchError as e:
                raise ValueError(str(e)) from None
        root = os.path.abspath(self.checkpoint_dir)
        if self.run_id:
            # A named job's checkpoints are its own: another job in the same directory neither
            # resumes from them nor prunes them. An unnamed job uses the directory itself.
            if self.run_id in (".", "..", "runs") or not _RUN_ID_RE.match(self.run_id):
                raise ValueError(f"--rdzv-id {self.run_id!r}: it names the job's checkpoint directory "
                                 "<checkpoint-dir>/<id>; use letters, digits, '.', '_' and '-' "
                                 "(not 'runs')")
            self.checkpoint_dir = os.path.join(root, self.run_id)
        else:
            self.checkpoint_dir = root
            self.run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        if not self.run_dir:
            self.run_dir = os.path.join(root, "runs", self.run_id)
        if self.transparent:
            if self.preload not in ("", "libjit"):
                raise ValueError(f"--transparent preloads jitckpt's libjit.so; drop --preload {self.preload!r}")
            self.preload = "libjit"
        if self.preload == "libjit":
            from jitckpt.native_libs import libjit_path

            try:
                self.preload = str(libjit_path())
            except FileNotFoundError as e:
                raise ValueError(str(e)) from None
        elif self.preload and not os.path.isfile(self.preload):
            raise ValueError(f"--preload {self.preload!r}: no such file")
        self._check_snapshot_flags()
        self._resolve_recovery()

    def _resolve_recovery(self) -> None:
        """Settle --recovery and --plugin. The logging plugin and --recovery stage are one recovery
        (a dead stage replaced alone, replaying from its neighbours' logs); undo and in-memory
        snapshots serve the other (every rank restarts from a JIT save or a snapshot)."""
        plugins = get_plugins(self.plugins)  # unknown names: ValueError
        modes = {p.recovery for p in plugins}
        if len(modes) > 1:
            raise ValueError(f"--plugin {','.join(self.plugins)}: the plugins serve different recoveries. "
                             + "; ".join(p.why for p in plugins) + ". Keep one")
        if self.recovery is None:
            self.recovery = modes.pop() if modes else "jit"
        if self.recovery not in RECOVERY_MODES:
            raise ValueError(f"--recovery {self.recovery!r}: choose one of {', '.join(RECOVERY_MODES)}")
        for p in plugins:
            if p.recovery != self.recovery and not (p.recovery == "jit" and self.recovery == "inprocess"):
                raise ValueError(f"--plugin {p.name} serves --recovery {p.recovery} ({p.why}), not "
                                 f"--recovery {self.recovery}: drop one of the two")
        if self.recovery == "stage" and LoggingPlugin() not in plugins:
            self.plugins = (*self.plugins, LoggingPlugin.name)  # stage recovery is the logging recovery
        if self.recovery == "stage" and self.no_python and not self.transparent:
            raise ValueError("--no-python with --recovery stage (--plugin logging): a native program's dead stage is "
                             "replaced through the device proxy, which rebuilds the survivors' communicators with "
                             "the replacement: add --transparent")
        if self.recovery == "stage" and self.nnodes > 1 and self.rdzv_backend in ("etcd", "etcd-v2"):
            raise ValueError("--recovery stage across nodes keeps its generations in a c10d store the workers reach; "
                             "with --rdzv-backend etcd it is not supported yet: use --rdzv-backend c10d")
        if self.recovery == "stage" and self.elastic:
            raise ValueError(f"--recovery stage replaces a dead stage in a job of fixed size; --nnodes "
                             f"{self.min_nodes}:{self.nnodes} may change it: give a fixed --nnodes")
        if self.recovery == "stage" and self.snapshot_every:
            raise ValueError("--recovery stage keeps the survivors' state in memory and replaces only the "
                             "dead rank; in-memory snapshots (--snapshot-every) serve --recovery jit. "
                             "Drop one of the two flags")

        if self.recovery == "inprocess":
            self._check_inprocess()

    def _check_inprocess(self) -> None:
        """What --recovery inprocess does not support yet, refused by name (each would run, but
        untested, or not at all: a native program cannot run its script again in its process)."""
        unsupported = [(self.no_python, "--no-python (a native program cannot run again in its own process)"),
                       (bool(self.preload or self.transparent), "--preload / --transparent (libjit.so's state "
                        "across a second run of the script is not handled yet)"),
                       (self.nnodes > 1, "--nnodes > 1 (one node only, for now)")]
        for bad, what in unsupported:
            if bad:
                raise ValueError(f"--recovery inprocess does not support {what}: use --recovery jit, which "
                                 "restarts every rank")

    def _check_snapshot_flags(self) -> None:
        if self.snapshot_every < 0 or self.snapshot_flush_every < 0:
            raise ValueError("--snapshot-every and --snapshot-flush-every must be >= 0 (0 = off)")
        if self.snapshot_protection is None:
            self.snapshot_protection = "aec" if self.nnodes >= 2 else "none"
        if self.snapshot_protection not in SNAPSHOT_PROTECTIONS:
            raise ValueError(f"--snapshot-protection {self.snapshot_protection!r}: choose one of "
                             f"{', '.join(SNAPSHOT_PROTECTIONS)}")
        if self.snapshot_zero not in SNAPSHOT_ZERO_MODES:
            raise ValueError(f"--snapshot-zero {self.snapshot_zero!r}: choose one of {', '.join(SNAPSHOT_ZERO_MODES)}")
        if self.snapshot_zero_copy_every < 1:
            raise ValueError(f"--snapshot-zero-copy-every {self.snapshot_zero_copy_every}: must be >= 1")
        if self.snapshot_zero_copy_every != 20 and self.snapshot_zero != "log":
            raise ValueError("--snapshot-zero-copy-every applies to --snapshot-zero log only; add "
                             "--snapshot-zero log or drop it")
        if self.snapshot_zero == "log" and self.snapshot_every not in (0, 1):
            raise ValueError(f"--snapshot-zero log keeps every step restorable and needs --snapshot-every 1 "
                             f"(got {self.snapshot_every}); for snapshots every N > 1 steps use "
                             "--snapshot-zero copy")
        if not self.snapshot_every:
            if self.snapshot_flush_every:
                raise ValueError("--snapshot-flush-every needs --snapshot-every N > 0 (snapshots are off)")
            if self.snapshot_zero != "recompute":
                raise ValueError(f"--snapshot-zero {self.snapshot_zero} needs --snapshot-every N > 0 "
                                 "(ZeRO partitions are protected in the in-memory snapshots)")
            return
        if self.snapshot_protection != "none" and self.nnodes < 2:
            raise ValueError(f"--snapshot-protection {self.snapshot_protection} keeps a lost node's "
                             "snapshot on another node and needs --nnodes >= 2; on one node use "
                             "--snapshot-protection none")

    @property
    def world_size(self) -> int:
        """The most ranks a generation has (MAX nodes'); a generation's own is the coordinator's."""
        return self.nnodes * self.nproc_per_node

    @property
    def elastic(self) -> bool:
        """--nnodes MIN:MAX with MIN < MAX: a generation may have fewer nodes than MAX."""
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def rdzv_host(self) -> str:
        return self.rdzv_endpoint.rpartition(":")[0] or "127.0.0.1"

    @property
    def rdzv_port(self) -> int:
        port = self.rdzv_endpoint.rpartition(":")[2]
        if not port.isdigit():
            raise ValueError(f"--rdzv-endpoint {self.rdzv_endpoint!r}: expected HOST:PORT")
        return int(port)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "LaunchConfig":
        script_args = list(a.script_args)
        if script_args and script_args[0] == "--":
            script_args = script_args[1:]
        refuse_torchrun_flags(a)
        min_nodes, max_nodes = a.nnodes if isinstance(a.nnodes, tuple) else (a.nnodes, a.nnodes)
        return cls(script=a.script, script_args=script_args, nnodes=max_nodes, min_nodes=min_nodes,
                   nproc_per_node=a.nproc_per_node, node_rank=a.node_rank,
                   rdzv_endpoint=a.rdzv_endpoint, rdzv_backend=a.rdzv_backend, run_id=a.rdzv_id, max_restarts=a.max_restarts,
                   module=a.module, no_python=a.no_python, checkpoint_dir=a.checkpoint_dir,
                   run_dir=a.run_dir, hang_timeout=a.hang_timeout, periodic_every=a.periodic_every,
                   save_timeout=a.save_timeout, warm_standby=a.warm_standby,
                   status_interval=a.status_interval, metrics_port=a.metrics_port,
                   metrics_addr=a.metrics_addr, preload=a.preload, transparent=a.transparent,
                   plugins=tuple(filter(None, a.plugin.split(","))), recovery=a.recovery,
                   snapshot_every=a.snapshot_every, snapshot_protection=a.snapshot_protection,
                   snapshot_flush_every=a.snapshot_flush_every, snapshot_zero=a.snapshot_zero,
                   snapshot_zero_copy_every=a.snapshot_zero_copy_every,
                   **_rdzv_conf(a.rdzv_conf),
                   role=a.role, master_addr=a.master_addr, master_port=a.master_port, local_addr=a.local_addr,
                   monitor_interval=a.monitor_interval, log_dir=a.log_dir, redirects=a.redirects, tee=a.tee,
                   local_ranks_filter=_local_ranks(a.local_ranks_filter))
