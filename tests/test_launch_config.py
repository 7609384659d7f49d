"""`jitckpt run` flags: torchrun spellings, validation with clear errors."""
from __future__ import annotations

import subprocess
import sys

import pytest

from jitckpt.cli import build_parser
from jitckpt.launcher.config import LaunchConfig
from jitckpt.hang_timeout import HangTimeout
from jitckpt.runtime.watchdog import DurationHistory


def parse(*argv):
    return LaunchConfig.from_args(build_parser().parse_args(["run", *argv]))


def test_torchrun_spellings_and_script_args(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = parse("--nproc_per_node", "3", "--max_restarts=1", "--standalone", str(script), "--lr", "0.1",
                "--log", "x")
    assert cfg.nproc_per_node == 3 and cfg.max_restarts == 1
    assert cfg.script_args == ["--lr", "0.1", "--log", "x"]
    cfg = parse("--nproc-per-node", "2", "--nnodes", "2:2", "--rdzv-endpoint", "10.0.0.1:29400",
                "--node-rank", "1", str(script))
    assert cfg.world_size == 4 and cfg.rdzv_host == "10.0.0.1" and cfg.rdzv_port == 29400


@pytest.mark.parametrize("argv,message", [
    (["--nnodes", "2"], "--rdzv-endpoint"),
    (["--nnodes", "1", "--node-rank", "1"], "--node-rank"),
    (["--plugin", "bogus"], "unknown plugin"),
    (["--plugin", "undo,logging"], "serve different recoveries"),
    (["--plugin", "undo", "--recovery", "stage"], "--recovery jit"),
    (["--plugin", "logging", "--recovery", "jit"], "--recovery stage.*drop one of the two"),
    (["--plugin", "logging", "--snapshot-every", "2"], "Drop one of the two flags"),
    (["--recovery", "stage", "--snapshot-every", "2"], "Drop one of the two flags"),
    (["--snapshot-zero", "copy"], "--snapshot-zero copy needs --snapshot-every"),
    (["--snapshot-zero", "log", "--snapshot-every", "2"], "needs --snapshot-every 1.*use --snapshot-zero copy"),
    (["--snapshot-zero-copy-every", "5", "--snapshot-every", "1"], "applies to --snapshot-zero log only"),
    (["--snapshot-zero", "log", "--snapshot-every", "1", "--snapshot-zero-copy-every", "0"], "must be >= 1"),
    (["--no-python", "--plugin", "logging"], "through the device proxy.*add --transparent"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379",
      "--recovery", "stage"], "not supported yet: use --rdzv-backend c10d"),
    (["--recovery", "inprocess", "--no-python"], "--recovery inprocess does not support --no-python"),
    (["--recovery", "inprocess", "--transparent"], "does not support --preload / --transparent"),
    (["--recovery", "inprocess", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29400"],
     "does not support --nnodes > 1"),
    (["--recovery", "inprocess", "--plugin", "logging"], "--plugin logging serves --recovery stage"),
])
def test_bad_config_is_named(tmp_path, argv, message):
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(ValueError, match=message):
        parse(*argv, str(script))


def test_logging_plugin_is_the_stage_recovery(tmp_path):
    """--plugin logging selects --recovery stage, and --recovery stage turns the plugin on (the
    workers see it in $JITCKPT_PLUGINS): they are one recovery, spelt either way."""
    script = tmp_path / "t.py"
    script.write_text("")
    for argv in (["--plugin", "logging"], ["--recovery", "stage"], ["--plugin", "logging", "--recovery", "stage"]):
        cfg = parse(*argv, str(script))
        assert (cfg.recovery, cfg.plugins) == ("stage", ("logging",)), argv
    cfg = parse(str(script))
    assert (cfg.recovery, cfg.plugins) == ("jit", ())
    cfg = parse("--plugin", "undo", str(script))
    assert (cfg.recovery, cfg.plugins) == ("jit", ("undo",))
    # undo serves the JIT save, which the in-process recovery makes too
    cfg = parse("--plugin", "undo", "--recovery", "inprocess", str(script))
    assert (cfg.recovery, cfg.plugins) == ("inprocess", ("undo",))


def test_missing_script_is_a_clear_cli_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "jitckpt", "run", str(tmp_path / "nope.py")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not found" in r.stderr


def test_nnodes_takes_torchruns_range_and_refuses_a_bad_one(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    cfg = parse("--nnodes", "2:3", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf",
                "last_call_timeout=4", str(script))
    assert (cfg.min_nodes, cfg.nnodes, cfg.elastic, cfg.last_call_timeout) == (2, 3, True, 4.0)
    assert not parse("--nnodes", "2:2", "--rdzv-endpoint", "127.0.0.1:1", str(script)).elastic
    for bad in ("3:2", "0:2", "x", "1:y"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["run", "--nnodes", bad, "x.py"])
    with pytest.raises(ValueError, match="--recovery stage replaces a dead stage in a job of fixed size"):
        parse("--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--recovery", "stage", str(script))


def test_hang_timeout_parsing():
    assert HangTimeout.parse("30").fixed == 30.0
    a = HangTimeout.parse("auto:floor=2,mult=5,startup=9,warmup=2")
    assert a.fixed is None and (a.floor, a.multiplier, a.startup, a.warmup) == (2, 5, 9, 2)
    assert HangTimeout.parse(a.to_text()) == a
    for bad in ("-1", "soon", "auto:floor", "auto:speed=3", "0"):
        with pytest.raises(ValueError):
            HangTimeout.parse(bad)


def test_one_hang_timeout_default_typed_or_not(tmp_path):
    """No --hang-timeout and `--hang-timeout auto` are the documented policy (was a 5 s floor when
    typed); the worker runtime's and the watchdog's defaults are the same."""
    documented = "auto:floor=30,mult=10,startup=120,window=64,warmup=3"
    script = tmp_path / "t.py"
    script.write_text("")
    for extra in ([], ["--hang-timeout", "auto"]):
        cfg = parse("--nproc-per-node", "1", *extra, str(script))
        assert cfg.hang_timeout == documented, extra
    assert HangTimeout().to_text() == HangTimeout.parse("auto").to_text() == documented
    assert HangTimeout.parse("30").to_text() == "30"


def test_adaptive_timeout_follows_recent_maximum():
    h = DurationHistory(HangTimeout(fixed=None, floor=1.0, multiplier=10, startup=60, warmup=3, window=4))
    assert h.timeout_for("backward") == 60          # not warmed up yet
    for d in (0.01, 0.02, 0.5):
        h.add("backward", d)
    assert h.timeout_for("backward") == pytest.approx(5.0)   # 10 x 0.5
    for d in (0.01, 0.01, 0.01, 0.01):
        h.add("backward", d)
    assert h.timeout_for("backward") == 1.0          # the floor, once the slow one left the window
    assert h.timeout_for("all_reduce") == 60          # kinds are tracked separately


def test_preload_libjit_shortcut(tmp_path, monkeypatch):
    script = tmp_path / "t.py"
    script.write_text("")
    lib = tmp_path / "libjit.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("JITCKPT_NATIVE_DIR", str(tmp_path))
    assert parse("--preload", "libjit", str(script)).preload == str(lib)
    with pytest.raises(ValueError, match="no such file"):
        parse("--preload", str(tmp_path / "missing.so"), str(script))


@pytest.mark.parametrize("argv,message", [
    (["--hang-timeout", "inf"], "hang timeout must be a finite number"),
    (["--hang-timeout", "nan"], "hang timeout must be a finite number"),
    (["--hang-timeout", "auto:floor=inf"], "floor must be a finite number"),
    (["--hang-timeout", "auto:mult=nan"], "multiplier must be a finite number"),
    (["--hang-timeout", "auto:startup=inf"], "startup must be a finite number"),
    (["--hang-timeout", "auto:floor=soon"], "'soon' is not a number"),
    (["--save-timeout", "nan"], "--save-timeout nan: expected a finite number of seconds > 0"),
    (["--save-timeout", "inf"], "--save-timeout inf: expected a finite number"),
    (["--save-timeout", "0"], "--save-timeout 0.0: expected a finite number"),
    (["--status-interval", "inf"], "--status-interval inf: expected a finite number of seconds >= 0"),
    (["--status-interval", "nan"], "--status-interval nan"),
    (["--monitor-interval", "nan"], "--monitor-interval"),
    (["--master-port", "70000"], "--master-port"),
])
def test_non_finite_or_out_of_range_numbers_refused(tmp_path, capsys, argv, message):
    """inf/nan would silently turn off what the flag bounds (hang detection, the exit barrier's
    and the JIT save's waits): every number flag is checked, with the flag named."""
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises((ValueError, SystemExit)) as info:
        parse(*argv, str(script))
    text = str(info.value) if info.type is ValueError else capsys.readouterr().err
    assert message in text, text


def test_unwritable_checkpoint_dir_refused_at_start(tmp_path):
    """With a separate --run-dir the checkpoint dir used to be first written at the first failure:
    a job whose JIT checkpoints cannot be written is refused before it starts (exit 2)."""
    script = tmp_path / "t.py"
    script.write_text("")
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "ckpt"  # cannot be created, even by root
    r = subprocess.run([sys.executable, "-m", "jitckpt", "run", "--checkpoint-dir", str(bad),
                        "--run-dir", str(tmp_path / "run"), "--warm-standby", "0", str(script)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"--checkpoint-dir {bad}: not a writable directory" in r.stderr
    ok = tmp_path / "new" / "ckpt"
    r = subprocess.run([sys.executable, "-m", "jitckpt", "run", "--checkpoint-dir", str(ok),
                        "--run-dir", str(tmp_path / "run2"), "--warm-standby", "0", str(script)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert ok.is_dir() and list(ok.iterdir()) == []  # created, and the probe file removed


def test_nproc_per_node_words_mean_what_they_mean_to_torchrun(tmp_path, capsys):
    """gpu: the visible CUDA devices (none here: a clear refusal); cpu: the CPU count; auto: the
    accelerators if any, else the CPU count (torchrun's own determine_local_world_size)."""
    import os

    import torch

    script = tmp_path / "train.py"
    script.write_text("")
    cpus = torch._utils.cpu_count() if hasattr(torch._utils, "cpu_count") else os.cpu_count()
    assert parse("--nproc-per-node", "cpu", str(script)).nproc_per_node == cpus
    want_auto = torch.accelerator.device_count() if torch.accelerator.is_available() else cpus
    assert parse("--nproc-per-node", "auto", str(script)).nproc_per_node == want_auto
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parse("--nproc-per-node", "gpu", str(script))
        assert "--nproc-per-node gpu: Cuda is not available." in capsys.readouterr().err
    for bad in ("0", "many"):
        with pytest.raises(SystemExit):
            parse("--nproc-per-node", bad, str(script))
        assert f"--nproc-per-node {bad}" in capsys.readouterr().err


def test_workers_get_malloc_huge_pages_unless_the_user_set_it():
    from jitckpt.launcher.supervisor import with_malloc_hugepages

    assert with_malloc_hugepages("") == "glibc.malloc.hugetlb=1"
    assert with_malloc_hugepages("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert with_malloc_hugepages("glibc.malloc.hugetlb=0") == "glibc.malloc.hugetlb=0"
