"""Where each worker's output goes: torchrun's ``--log-dir``, ``-r/--redirects``, ``-t/--tee`` and
``--local-ranks-filter``, with torchrun's meaning and file layout
(``<log dir>/<run id>/attempt_<generation>/<local rank>/{stdout.log,stderr.log,error.json}``;
with several nodes ``<log dir>/<run id>/node<node rank>/attempt_...``: the log and run directories
are usually on a filesystem every node shares, where torchrun makes its run directory unique with a
random suffix instead, and each attempt empties its directories), and
the ``TORCHELASTIC_ERROR_FILE`` that a script's ``@record`` writes its exception to. torch's own
``Std`` parses the flags and its ``TailLog`` prints tee'd files, imported only when asked (the
launcher does not import torch otherwise).
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from jitckpt.launcher.config import LaunchConfig

OUT, ERR = 1, 2  # torchrun's Std bits


@dataclass(frozen=True)
class WorkerStreams:
    """One worker's destinations: a file path, ``os.devnull``, or None for this console."""

    stdout: Optional[str]
    stderr: Optional[str]
    error_file: str


class WorkerLogs:
    """One launcher's worker log layout and its tails on the console."""

    def __init__(self, cfg: LaunchConfig, run_dir: Path) -> None:
        self.root = Path(cfg.log_dir) / cfg.run_id if cfg.log_dir else run_dir / "logs"
        if cfg.nnodes > 1:  # one node's attempt must not empty another's (a shared filesystem)
            self.root /= f"node{cfg.node_rank}"
        self.role = cfg.role
        self.filter = cfg.local_ranks_filter
        self._redirects = self._std_map(cfg.redirects, cfg.nproc_per_node)
        self._tee = self._std_map(cfg.tee, cfg.nproc_per_node)
        self._tails: list = []

    @staticmethod
    def _std_map(text: str, nproc: int) -> dict[int, int]:
        if text == "0":
            return dict.fromkeys(range(nproc), 0)
        from torch.distributed.elastic.multiprocessing.api import Std, to_map

        return {lr: int(v) for lr, v in to_map(Std.from_str(text), nproc).items()}

    def attempt(self, gen: int, local_ranks: list[int]) -> dict[int, WorkerStreams]:
        """Make generation ``gen``'s directories (emptied, as torchrun does per attempt) for
        ``local_ranks``, start tailing what is tee'd, and say where each worker writes."""
        out: dict[int, WorkerStreams] = {}
        tee: tuple[dict[int, str], dict[int, str]] = ({}, {})  # stdout, stderr files per local rank
        for lr in local_ranks:
            d = self.root / f"attempt_{gen}" / str(lr)
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            teed = self._tee.get(lr, 0)
            redirect = self._redirects.get(lr, 0) | teed  # a tee'd stream is a file that is tailed
            shown = not self.filter or lr in self.filter
            streams: list[Optional[str]] = []
            for i, (bit, name) in enumerate(((OUT, "stdout.log"), (ERR, "stderr.log"))):
                if redirect & bit:
                    streams.append(str(d / name))
                    if teed & bit and shown:
                        tee[i][lr] = str(d / name)
                else:
                    streams.append(None if shown else os.devnull)
            out[lr] = WorkerStreams(stdout=streams[0], stderr=streams[1], error_file=str(d / "error.json"))
        for files, dst in zip(tee, (sys.stdout, sys.stderr)):
            if files:
                self._tail(files, dst)
        return out

    def _tail(self, files: dict[int, str], dst) -> None:  # type: ignore[no-untyped-def]
        from torch.distributed.elastic.multiprocessing.tail_log import TailLog

        tail = TailLog(self.role, files, dst)  # torchrun's prefix: [<role><local rank>]:
        tail.start()
        self._tails.append(tail)

    def stop(self) -> None:
        """Print what the tee'd files still hold and stop tailing (at a generation's end)."""
        for tail in self._tails:
            tail.stop()
        self._tails.clear()
