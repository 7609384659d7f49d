"""The step board: a worker's step reaches the launcher through shared memory, and outlives it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jitckpt.protocol.step_board import ENV_FD, StepBoard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import os, sys
from jitckpt.protocol.step_board import ENV_FD, StepBoard
board = StepBoard.from_env()
assert ENV_FD not in os.environ  # consumed: the worker's own children do not get it
for step in range(int(sys.argv[1])):
    board.post(step, 0.25 if step == 3 else None)
os.kill(os.getpid(), 9)  # dies without a word: the board still has its last step
"""


def test_a_dead_workers_last_step_and_time_stay_on_the_board():
    board = StepBoard.create()
    assert board.step() is None and board.step_time() is None
    env = {**os.environ, ENV_FD: str(board.fileno()), "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", CHILD, "1000"], env=env, pass_fds=(board.fileno(),),
                       timeout=60)
    assert p.returncode == -9
    assert board.step() == 999 and board.step_time() == 0.25
    board.close()
    board.close()  # twice: no error


def test_the_descriptor_is_not_left_to_the_workers_children():
    board = StepBoard.create()
    env = {**os.environ, ENV_FD: str(board.fileno()), "PYTHONPATH": ROOT}
    code = ("import os; from jitckpt.protocol.step_board import StepBoard; fd = os.environ['" + ENV_FD
            + "']; b = StepBoard.from_env(); b.post(7); print(os.path.exists(f'/proc/self/fd/{fd}'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, pass_fds=(board.fileno(),),
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
    assert board.step() == 7


def test_a_bad_descriptor_says_what_to_do(monkeypatch):
    monkeypatch.setenv(ENV_FD, "987654")
    with pytest.raises(RuntimeError, match="not a step board.*jitckpt run"):
        StepBoard.from_env()
