"""What torchrun gives a worker and a user, jitckpt run gives too (issue 18): the error file that
``@record`` writes, torchrun's OMP_NUM_THREADS warning, and process titles that tell ranks apart."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from jobs import run_bounded

SCRIPT = '''
import os
import setproctitle
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    rank = int(os.environ["RANK"])
    with open(f"title{rank}.txt", "w") as f:
        f.write(setproctitle.getproctitle() + "\\n" + os.environ["OMP_NUM_THREADS"])
    if rank == 1:
        raise RuntimeError("boom from rank 1")

main()
'''


def test_record_error_file_omp_warning_and_process_titles(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "rec.py"
    script.write_text(SCRIPT)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # torchrun warns only when it sets it
    rc, out = run_bounded([sys.executable, "-m", "jitckpt", "run", "--nproc-per-node", "2", "--max-restarts", "0",
                           "--checkpoint-dir", str(tmp_path / "ck"), "--run-dir", str(tmp_path / "run"),
                           "--status-interval", "0", str(script)], cwd=tmp_path, timeout=120)
    assert rc == 1, out[-3000:]
    # @record wrote rank 1's exception where TORCHELASTIC_ERROR_FILE pointed, in torchrun's format.
    error = json.loads((tmp_path / "run" / "errors" / "gen0" / "rank1" / "error.json").read_text())
    assert error["message"]["message"] == "RuntimeError: boom from rank 1", error
    assert "boom from rank 1" in error["message"]["extraInfo"]["py_callstack"]
    assert not (tmp_path / "run" / "errors" / "gen0" / "rank0" / "error.json").exists()
    # torchrun's warning, once, when it sets OMP_NUM_THREADS for the user.
    assert out.count("Setting OMP_NUM_THREADS environment variable for each process to be 1") == 1, out[-3000:]
    for rank in (0, 1):
        title, omp = (tmp_path / f"title{rank}.txt").read_text().splitlines()
        assert title == f"jitckpt rank {rank}/2 gen 0" and omp == "1"
