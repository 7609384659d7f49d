"""In-process recovery (``jitckpt run --recovery inprocess``), a survivor's side.

After a peer's failure a survivor writes its JIT checkpoint as in the JIT recovery, but does not
exit: its training thread leaves the user's script with :class:`InProcessRestart`, raised where
the thread stands (the collective that failed, or the safe point it reached), once the launcher
said every survivor saved and the groups' connections were cut (:mod:`jitckpt.runtime.group_sockets`:
a peer still blocked on this rank errors out at once); the groups of the generation that ended are
destroyed, and the process waits for its next assignment. The launcher then
gives every survivor its own rank again and a warm standby the lost one, and each runs the script
anew in the process it has: torch imported, its memory already faulted in, the compiled script
(:class:`ScriptRunner`) and torch.compile's caches kept. ``restore()`` loads the step every
survivor saved, so everyone redoes the failed minibatch from the same state.
"""
from __future__ import annotations

import builtins
import logging
import os
import runpy
import sys
import types
from typing import Optional

log = logging.getLogger("jitckpt.worker")


class InProcessRestart(BaseException):
    """Raised in a survivor's training thread to leave the script after a peer's failure.

    A BaseException, as KeyboardInterrupt is, so that a script's ``except Exception`` around its
    training step does not swallow it."""


def release_process_groups() -> Optional[str]:
    """Destroy every torch.distributed process group of the ended generation, so the script can
    call ``init_process_group`` again; None when done, else why it could not be."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:  # (the connections were cut before the training thread left: WorkerRuntime._leave_script)
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - said by the caller, which then restarts this rank
        return f"destroy_process_group() raised {type(e).__name__}: {e}"
    return "the default process group is still initialized" if dist.is_initialized() else None


class ScriptRunner:
    """The user's script (or ``-m`` module) run as ``__main__``, once per generation, from one
    code object compiled at the first run.

    The functions the script defines then have the same code objects in every run, and
    torch.compile's dynamo caches its compiled frames on code objects: a survivor that runs the
    script again finds them where the guards still hold (a model of torch's own modules). A class
    the script defines is a new class in each run, so a compiled method of it is traced again,
    against inductor's caches in this process (measured: 0.055 s, against 2.1 s at the first
    run). The module's globals are set as ``runpy.run_path`` / ``run_module`` set them."""

    def __init__(self, argv: list[str], *, module: bool) -> None:
        self.argv = list(argv)
        self.module = module
        self._code: Optional[types.CodeType] = None
        self._globals: dict = {}
        self._main: Optional[types.ModuleType] = None

    def run(self) -> None:
        """Run the script once, with ``sys.argv`` set as for ``python script.py args``."""
        if self._code is None:
            self._load()
        sys.argv = list(self.argv)
        if self._main is None:
            self._main = types.ModuleType("__main__")
        main = self._main  # after forget(), the same dict: dynamo's compiled frames look their helpers up there
        main.__dict__.update(self._globals, __builtins__=builtins)
        saved = sys.modules.get("__main__")
        sys.modules["__main__"] = main  # pickling (a DataLoader's spawned workers) finds it there
        try:
            exec(self._code, main.__dict__)
        finally:
            if saved is not None:
                sys.modules["__main__"] = saved

    def forget(self) -> None:
        """Drop what the last run defined: its globals reference each other through its functions,
        so deleting them frees the run's model and optimizer without a full garbage collection.
        Dunder names stay, and the next run gets the same dict: torch.compile keeps its compiled
        functions there (``__compiled_fn_*``, ``__builtins_dict___*``), and a cached frame the
        next run reuses looks them up there."""
        if self._main is not None:
            d = self._main.__dict__
            for name in [k for k in d if not k.startswith("__")]:
                del d[name]

    def _load(self) -> None:
        if self.module:
            _, spec, self._code = runpy._get_module_details(self.argv[0])  # type: ignore[attr-defined]
            self._globals = dict(__file__=spec.origin, __cached__=spec.cached, __doc__=None,
                                 __loader__=spec.loader, __package__=spec.parent, __spec__=spec)
            return
        script = self.argv[0]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        with open(script, "rb") as f:
            self._code = compile(f.read(), script, "exec")
        self._globals = dict(__file__=script, __cached__=None, __doc__=None, __loader__=None,
                             __package__="", __spec__=None)
