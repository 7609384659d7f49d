"""Integrated SWIFT recovery in data-parallel training (3 gloo ranks, real processes).

One rank SIGKILLs itself in the middle of its optimizer step at iteration FAIL_IT, after
updating K of its parameters. As in SWIFT (the all-reduce of each gradient is waited for just
before that parameter's update), the survivors have then updated exactly the K parameters whose
all-reduce completed, and the wait for parameter K raises. Survivors undo the partial step with
UpdateUndo, a replacement process joins a new process group, rank 0 broadcasts its state to
every rank, and training re-runs iteration FAIL_IT. The loss trajectory is compared with a
failure-free run of the same script.

Stated bound: right after the undo, every parameter is within the stated UpdateUndo bound of
the failure-free run's value (2*eps*(|x1| + |x1 - x0|) + eps*|x0| elementwise: the stated
parameter bound with c = 1 and |D| = |x1 - x0| up to rounding, as both optimizers run without
weight decay; Adam and SGD with nesterov momentum); the re-run iteration's loss then differs by at most sum_i |dL/dx_i| * bound_i
(first order, times 2 for the second-order remainder) plus the float32 rounding of the loss,
and later losses by at most LOSS_REL_BOUND = 1e-5 relative (~80 float32 ulp: the few-ulp
perturbation carried through the remaining Adam steps of this small, well-conditioned model;
an empirical margin, not a derived constant). Observed here: about ten elements of the undone
tensors differ from the failure-free run by 1 ulp, and every logged loss is bitwise equal.

Workers are forked from the test process (torch already imported, so they start at once) and
killed by PID on exit; each run has a deadline of PROC_TIMEOUT seconds.
"""
from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest


WORLD, FAIL_RANK, FAIL_IT, K, ITERS = 3, 2, 5, 2, 12
LOSS_REL_BOUND = 1e-5
PROC_TIMEOUT = 60.0  # per run; a healthy run takes a few seconds
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"


# ------------------------------------------------------------------ worker side ------------
def _group(port: int, generation: str, rank: int):
    """A gloo group on the test's TCPStore; abandoned (never destroyed) after a failure, since
    tearing down a group with a dead peer waits for its full timeout."""
    import torch.distributed as dist

    timeout = timedelta(seconds=15)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(generation, store), rank, WORLD, timeout)


OPTIMIZERS = {
    # name: (factory of a for-loop optimizer, name for train_ddp.overlap_step_with_allreduce)
    "adam": (lambda ps, torch: torch.optim.Adam(ps, lr=0.02, foreach=False), "adam"),
    "sgd-nesterov": (lambda ps, torch: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                                       foreach=False), "sgd"),
}


def _train_ddp():
    """examples/train_ddp.py as a module: its overlapped optimizer step (SWIFT's overlap)."""
    spec = importlib.util.spec_from_file_location("train_ddp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker(rank: int, port: int, mode: str, out: str, kind: str) -> None:
    import torch

    from jitckpt.swift import UpdateUndo

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    params = list(model.parameters())
    make_opt, optim_name = OPTIMIZERS[kind]
    opt = make_opt(params, torch)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    undo = UpdateUndo(opt, sched)
    works: dict[int, object] = {}
    dying = mode == "fail" and rank == FAIL_RANK
    current = {"it": -1}

    def wait(i, p):
        # SWIFT: wait for this tensor's all-reduce, then launch its update.
        if dying and current["it"] == FAIL_IT and i == K:
            os.kill(os.getpid(), signal.SIGKILL)
        works[id(p)].wait()

    _train_ddp().overlap_step_with_allreduce(optim_name, wait)
    result: dict = {"losses": {}, "rank": rank}
    if mode == "replacement":
        pg = _group(port, "gen1", rank)
        it = _broadcast_state(pg, rank, model, opt, sched, -1)
    else:
        pg = _group(port, "gen0", rank)
        it = 0
    abandoned = []
    while it < ITERS:
        current["it"] = it
        gen = torch.Generator().manual_seed(1000 * it + rank)
        x = torch.randn(32, 8, generator=gen)
        y = x[:, :3].sum(dim=1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=gen)
        if mode == "ref" and rank == 0 and it == FAIL_IT:
            result["x_ref"] = [p.detach().tolist() for p in params]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if mode == "ref" and it == FAIL_IT:
            result["grad_abs_local"] = [p.grad.detach().abs().tolist() for p in params]
        gl = loss.detach().clone()
        try:
            pg.allreduce([gl]).wait()
            for p in params:
                p.grad.div_(WORLD)
            # The failing rank had contributed only the first K gradients when it died.
            launch = params[:K] if (dying and it == FAIL_IT) else params
            for p in launch:
                works[id(p)] = pg.allreduce([p.grad])
            if rank == 0:
                result["losses"][it] = float(gl) / WORLD
            opt.step()
            sched.step()
        except RuntimeError as exc:  # a peer died: SWIFT recovery on the survivors
            result["failure"] = {"it": it, "error": str(exc)[:200]}
            result["x1"] = [p.detach().tolist() for p in params]
            result["undone"] = undo.undo_last_step()
            result["x_undone"] = [p.detach().tolist() for p in params]
            result["state_digest"] = _digest(params, opt)
            abandoned.append(pg)
            pg = _group(port, "gen1", rank)
            it = _broadcast_state(pg, rank, model, opt, sched, it)
            continue
        it += 1
    result["final_digest"] = _digest(params, opt)
    Path(out).write_text(json.dumps(result))


def _digest(params, opt) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().numpy().tobytes())
        for k in sorted(opt.state[p]):
            h.update(opt.state[p][k].numpy().tobytes())
    return h.hexdigest()


def _broadcast_state(pg, rank, model, opt, sched, it) -> int:
    """Rank 0 sends model, optimizer and scheduler state and the iteration to every rank."""
    import io

    import torch

    if rank == 0:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "it": it}, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    pg.broadcast(size, 0).wait()
    if rank != 0:
        data = torch.empty(int(size), dtype=torch.uint8)
    pg.broadcast(data, 0).wait()
    if rank == 0:
        return it
    state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    return int(state["it"])


# -------------------------------------------------------------------- test side -------------
def _child(rank: int, port: int, mode: str, out: str, kind: str) -> None:
    try:
        _worker(rank, port, mode, out, kind)
    except BaseException as exc:  # report, then exit non-zero without running parent cleanup
        Path(out + ".err").write_text(repr(exc))
        os._exit(1)
    os._exit(0)


class _Procs:
    """Worker processes of one run, forked from the test process (torch is already imported,
    so a worker starts in milliseconds); killed by PID on exit."""

    def __init__(self, tmp: Path, kind: str) -> None:
        from jitckpt.swift.pipeline.store import StoreServer

        self.tmp, self.kind = tmp, kind
        # The store's server thread lives in its own process: forking next to it can hang a child.
        self.store = StoreServer()
        self.port = self.store.port
        self.procs: dict[str, multiprocessing.process.BaseProcess] = {}

    def spawn(self, name: str, rank: int, mode: str) -> None:
        ctx = multiprocessing.get_context("fork")
        proc = ctx.Process(target=_child, args=(rank, self.port, mode,
                                               str(self.tmp / f"{name}.json"), self.kind),
                           daemon=True)
        proc.start()
        self.procs[name] = proc

    def wait(self, name: str, deadline: float) -> int:
        proc = self.procs[name]
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
        if proc.exitcode is None:
            raise AssertionError(f"worker {name} did not finish within {PROC_TIMEOUT}s")
        return proc.exitcode

    def error(self, name: str) -> str:
        err = self.tmp / f"{name}.json.err"
        return err.read_text() if err.exists() else ""

    def result(self, name: str) -> dict:
        return json.loads((self.tmp / f"{name}.json").read_text())

    def __enter__(self) -> "_Procs":
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.exitcode is None and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=10)
        self.store.stop()


def _run(tmp: Path, mode: str, kind: str) -> dict[str, dict]:
    import torch

    # Build an optimizer once before forking: its first construction imports torch._dynamo
    # (seconds), which the forked workers then share.
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    tmp.mkdir()
    deadline = time.monotonic() + PROC_TIMEOUT
    with _Procs(tmp, kind) as run:
        for r in range(WORLD):
            run.spawn(f"r{r}", r, mode)
        if mode == "fail":
            rc = run.wait(f"r{FAIL_RANK}", deadline)
            assert rc == -signal.SIGKILL, f"failing rank exited {rc}: {run.error(f'r{FAIL_RANK}')}"
            run.spawn("replacement", FAIL_RANK, "replacement")
        names = [n for n in run.procs if not (mode == "fail" and n == f"r{FAIL_RANK}")]
        for name in names:
            rc = run.wait(name, deadline)
            assert rc == 0, f"{name} exited {rc}: {run.error(name)}"
        return {n: run.result(n) for n in names}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_failure_mid_optimizer_step_recovers_by_undo_and_broadcast(tmp_path, kind):
    import torch

    ref = _run(tmp_path / "ref", "ref", kind)
    fail = _run(tmp_path / "fail", "fail", kind)
    r0, r1 = fail["r0"], fail["r1"]
    # Both survivors saw the failure inside step FAIL_IT and undid exactly K parameters.
    for r in (r0, r1):
        assert r["failure"]["it"] == FAIL_IT, r["failure"]
        assert r["undone"] == K
    # Survivors with identical progress undo to bitwise-identical state.
    assert r0["state_digest"] == r1["state_digest"]
    # After recovery every rank (survivors and replacement) holds the same state.
    digests = {fail[n]["final_digest"] for n in ("r0", "r1", "replacement")}
    assert len(digests) == 1
    # Undo accuracy against the failure-free run's parameters at the start of FAIL_IT.
    eps = torch.finfo(torch.float32).eps
    slack = 8 * torch.finfo(torch.float32).tiny * eps
    bounds = []
    for x1, xu, x0 in zip(r0["x1"], r0["x_undone"], ref["r0"]["x_ref"]):
        x1, xu, x0 = (torch.tensor(v, dtype=torch.float64) for v in (x1, xu, x0))
        bound = 2 * eps * (x1.abs() + (x1 - x0).abs()) + eps * x0.abs() + slack
        assert ((xu - x0).abs() <= bound).all(), float(((xu - x0).abs() - bound).max())
        bounds.append(bound)
    # First-order loss bound of the re-run iteration: the logged loss is the mean of the ranks'
    # local losses, so sum_i mean_r |dL_r/dx_i| * bound_i (doubled for the remainder).
    loss_bound = 0.0
    for r in range(WORLD):
        for gabs, bound in zip(ref[f"r{r}"]["grad_abs_local"], bounds):
            loss_bound += float((torch.tensor(gabs, dtype=torch.float64) * bound).sum()) / WORLD
    # Loss trajectory: identical before the failure, within the bound after it.
    ref_losses, fail_losses = ref["r0"]["losses"], r0["losses"]
    assert sorted(ref_losses, key=int) == sorted(fail_losses, key=int)
    for it in sorted(ref_losses, key=int):
        a, b = ref_losses[it], fail_losses[it]
        if int(it) < FAIL_IT:
            assert a == b, (it, a, b)
        elif int(it) == FAIL_IT:
            assert abs(a - b) <= 2 * loss_bound + 4 * eps * abs(a), (it, a, b, loss_bound)
        else:
            assert abs(a - b) <= LOSS_REL_BOUND * abs(a), (it, a, b)

