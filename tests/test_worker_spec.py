"""One frozen, validated worker spec, built once by the launcher and sent with the rank (issue 14):
not a dozen environment variables. The environment remains for processes the launcher did not
start (torchrun, plain python, a --no-python program's libjit.so)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from jobs import ROOT
from jitckpt.protocol.worker_spec import ENVIRONMENT, SnapshotSpec, StageSpec, WorkerSpec


def test_round_trip_and_normalized_policy():
    spec = WorkerSpec(rank=1, world_size=2, gen=3, checkpoint_dir="/c", hang_timeout="auto",
                      plugins=["undo"], snapshot=SnapshotSpec(socket="/s", every=2, protection="aec"),
                      stage=None)
    assert spec.hang_timeout == "auto:floor=30,mult=10,startup=120,window=64,warmup=3"
    assert spec.plugins == ("undo",)
    again = WorkerSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    with pytest.raises(dataclasses_error()):
        spec.rank = 0  # frozen


def dataclasses_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("kwargs,message", [
    (dict(rank=2, world_size=2), r"rank 2 is not in \[0, world_size=2\)"),
    (dict(hang_timeout="soon"), "expected seconds"),
    (dict(save_timeout=float("nan")), "save_timeout must be a finite number"),
    (dict(plugins=("cache",)), r"unknown plugin\(s\) \['cache'\]"),
    (dict(checkpoint_dir=""), "checkpoint_dir is empty"),
])
def test_bad_specs_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WorkerSpec(**{"checkpoint_dir": "/c", **kwargs})


def test_sub_specs_are_checked():
    with pytest.raises(ValueError, match="protection 'raid5'"):
        SnapshotSpec(socket="/s", every=1, protection="raid5")
    with pytest.raises(ValueError, match="every must be > 0"):
        SnapshotSpec(socket="/s", every=0)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        StageSpec(store="localhost")


def test_environment_of_a_process_without_the_launcher():
    env = {"RANK": "1", "WORLD_SIZE": "3", "TORCHELASTIC_RESTART_COUNT": "2",
           "JITCKPT_CHECKPOINT_DIR": "/ck", "JITCKPT_HANG_TIMEOUT": "45", "JITCKPT_PERIODIC_EVERY": "5",
           "JITCKPT_PLUGINS": "undo"}
    spec = WorkerSpec.from_env(env)
    assert (spec.rank, spec.world_size, spec.gen, spec.checkpoint_dir, spec.hang_timeout,
            spec.periodic_every, spec.plugins) == (1, 3, 2, "/ck", "45", 5, ("undo",))
    assert set(spec.to_env()) == set(ENVIRONMENT)  # the one table is what --no-python gets
    assert WorkerSpec.from_env(spec.to_env() | {"RANK": "1", "WORLD_SIZE": "3"}) == spec
    with pytest.raises(ValueError, match=r"\$JITCKPT_PERIODIC_EVERY='often': expected a number"):
        WorkerSpec.from_env({"JITCKPT_PERIODIC_EVERY": "often"})


def test_workers_of_jitckpt_run_get_the_spec_not_environment_variables(tmp_path):
    """Under the launcher a worker's JITCKPT_* environment is only the control channel's fd; its
    runtime holds the spec the launcher built."""
    script = tmp_path / "show.py"
    out = tmp_path / "seen"
    script.write_text(textwrap.dedent(f"""
        import json, os
        import jitckpt
        from jitckpt.runtime.current import get_runtime
        jitckpt.init(lambda path: None)
        spec = get_runtime().spec
        with open({str(out)!r} + os.environ["RANK"], "w") as f:
            json.dump({{"env": sorted(k for k in os.environ if k.startswith("JITCKPT_")),
                        "spec": spec.to_dict()}}, f)
    """))
    proc = subprocess.run([sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "2",
                           "--periodic-every", "7", "--hang-timeout", "9",
                           "--run-dir", str(tmp_path / "run"), "--checkpoint-dir", str(tmp_path / "ck"),
                           str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seen{rank}").read_text())
        assert seen["env"] == ["JITCKPT_CONTROL_FD"], seen["env"]
        spec = seen["spec"]
        assert (spec["rank"], spec["world_size"], spec["periodic_every"], spec["hang_timeout"],
                spec["host_store"]) == (rank, 2, 7, "9", True)
        assert spec["checkpoint_dir"] == str(tmp_path / "ck")
