"""jitckpt: just-in-time checkpointing for distributed PyTorch training.

A training script needs two lines::

    import jitckpt
    state = jitckpt.protect(model, optimizer, scheduler)   # registers a correct save function
    for step in range(state.restore(), total_steps):         # resumes from the newest checkpoint
        ...

or, with its own save function::

    jitckpt.init(save_fn)                  # save_fn(path) saves model/optimizer/step/RNG into path
    path = jitckpt.get_checkpoint_path()   # a complete checkpoint directory to resume from, or None

Run it with ``jitckpt run --nproc-per-node N script.py`` (torchrun's flags), or under torchrun or
plain python: without the launcher a failure still triggers the save and the process exits with
code 75, for the scheduler to restart it.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Optional

from jitckpt.protocol.exit_codes import EXIT_JIT_SAVED, EXIT_NO_SAVE
from jitckpt.runtime.current import get_runtime as _get_runtime

if TYPE_CHECKING:  # torch is imported only by workers, not by the launcher
    from jitckpt.runtime.protected_state import Protected
    from jitckpt.runtime.worker_runtime import WorkerRuntime

__version__ = "0.1.0"
__all__ = ["init", "get_checkpoint_path", "protect", "mark_step", "blocking_region", "export_dcp", "Protected", "EXIT_JIT_SAVED",
           "EXIT_NO_SAVE"]

def __getattr__(name: str) -> Any:
    if name == "Protected":
        from jitckpt.runtime.protected_state import Protected
        return Protected
    raise AttributeError(f"module 'jitckpt' has no attribute {name!r}")


def init(save_fn: Callable[[str], Optional[str]], *, step_fn: Optional[Callable[[], int]] = None,
         shard_id: int = 0, num_shards: int = 1, checkpoint_dir: Optional[str] = None) -> None:
    """Register the function that saves this rank's state after a failure.

    ``save_fn(path)`` must write model, optimizer, step counter and RNG state into the existing
    directory ``path`` without any collective communication (peers may be dead); it may return the
    relative name of what a framework resumes from inside ``path`` (a Trainer's ``checkpoint-<step>``
    directory), which :func:`get_checkpoint_path` then returns. ``step_fn()``
    returns the number of completed optimizer steps (used to pick the newest checkpoint; without
    it jitckpt counts ``optimizer.step()`` calls). ``shard_id``/``num_shards`` describe model
    parallelism: ranks with the same shard_id are data-parallel replicas (default: pure data
    parallelism, one shard). ``checkpoint_dir`` overrides ``$JITCKPT_CHECKPOINT_DIR`` (set by
    ``jitckpt run --checkpoint-dir``).

    Compared with :func:`protect`: JIT saves, the recovery summary and the heartbeat work the same
    (the optimizer steps are the signs of progress). ``jitckpt run --periodic-every`` needs
    :func:`mark_step` at the top of each iteration: jitckpt cannot tell where ``save_fn``'s state
    (your step counter, scheduler, data position) is consistent, so without it no periodic
    checkpoint is taken and the ranks that would take one say so once (console and a ``warning``
    event).
    """
    if checkpoint_dir is not None:
        os.environ["JITCKPT_CHECKPOINT_DIR"] = os.path.abspath(checkpoint_dir)
    rt = _get_runtime()
    if checkpoint_dir is not None:
        rt.checkpoint_dir = os.path.abspath(checkpoint_dir)
        if rt.snapshots is not None:
            rt.snapshots.checkpoint_dir = rt.checkpoint_dir
    rt.set_save_fn(save_fn, step_fn=step_fn, shard_id=shard_id, num_shards=num_shards)


def get_checkpoint_path() -> Optional[str]:
    """Directory of the newest complete checkpoint for this rank's shard (or the entry inside it
    that its save function named, such as a Trainer's ``checkpoint-<step>/``), or None.

    Checks every candidate against its metadata (sizes, CRC32C) and skips incomplete or corrupt
    ones with a logged warning; a JIT checkpoint from any data-parallel replica qualifies, and so
    does a snapshot flushed to disk. In-memory snapshots (``jitckpt run --snapshot-every``) have
    no path: they are taken and restored by :func:`protect` and ``restore()``.
    """
    return _get_runtime().select_checkpoint()


def export_dcp(checkpoint_dir: str, out: str) -> str:
    """Write the newest complete checkpoint of a DTensor-sharded job (FSDP2, HSDP, TP) under
    ``checkpoint_dir`` as a plain ``torch.distributed.checkpoint`` directory ``out`` (hard links to
    its shards, then ``.metadata``): ``dcp.load({"model": model.state_dict()}, checkpoint_id=out)``
    reads it on any mesh. Keys: ``model.<name>``, ``optim.<parameter name>.<state key>``."""
    from jitckpt.runtime.sharded_state import export_newest

    return str(export_newest(checkpoint_dir, out))


class blocking_region:
    """Context manager marking code that waits on other ranks (a collective jitckpt cannot see).

    While the main thread is inside, a hang shows up as a region that outlives the hang timeout,
    and a JIT save may run on a helper thread (the main thread is held until it is done). Use it
    around e.g. a native all-reduce + synchronize called through ctypes::

        with jitckpt.blocking_region("allreduce"):
            lib.train_step(step)
    """

    def __init__(self, kind: str = "collective") -> None:
        self.kind = kind

    def __enter__(self) -> "blocking_region":
        self._rt = _get_runtime()
        self._tok = self._rt.region_enter(self.kind)
        return self

    def __exit__(self, etype, exc, tb) -> None:  # type: ignore[no-untyped-def]
        self._rt.region_exit(self._tok, exc)


def mark_step(step: int) -> None:
    """Optional: call at the top of each iteration with the number of completed steps.

    A minibatch boundary is a safe point for a pending JIT save and where ``--periodic-every``
    checkpoints are taken. ``protect()`` calls this for you from the model's forward pre-hook.
    """
    _get_runtime().mark_step(step)


def protect(model: Any, optimizer: Any, scheduler: Any = None, *, extra: Optional[dict] = None,
            shard_id: int = 0, num_shards: int = 1, dataloader: Any = None) -> "Protected":
    """Make model, optimizer, scheduler, RNG states and step counter recoverable.

    Registers :meth:`Protected.save` with :func:`init`; call ``restore()`` on the result to resume.
    See :class:`Protected` for exactly which step a resumed job continues from. Under
    ``jitckpt run --snapshot-every N`` it also takes in-memory snapshots of the same state, and
    ``restore()`` (then collective) resumes from the newest of them and the disk checkpoints.
    A ``ZeroRedundancyOptimizer`` is accepted under ``--snapshot-every`` on >= 2 nodes only: its
    partitions are protected by AOR in the keepers, and after a failure the job resumes from the
    newest snapshot (no JIT save: a lost rank's partition is nowhere else). At a preemption, and
    every N steps with ``--periodic-every N``, every rank saves its own shard (the parameters and
    its partition), so the next run resumes from disk even when the keepers are gone.
    Under ``jitckpt run --plugin undo`` a failure that tears the optimizer step (inside
    ``optimizer.step()``, or before the scheduler's step of the same minibatch) is undone by SWIFT
    update-undo before the JIT save, so the survivors still save the start of that minibatch;
    an optimizer without an exact inverse is refused here (:class:`jitckpt.swift.UpdateUndo`).
    ``dataloader``: a loader with ``state_dict()``/``load_state_dict()`` (torchdata's
    ``StatefulDataLoader``), or a plain ``DataLoader`` (fast-forwarded: the batches of the epoch
    already trained on are read past, with a warning of what that cost), iterated once per
    optimizer step; ``restore()`` puts it at the failed minibatch (its state once the previous step
    was done), and the loop resumes at epoch ``step // len(loader)``. Under ``jitckpt run`` each
    rank resumes with its own loader state and RNG (from the node's rank-state board); a rank whose
    own the saver did not know resumes with the saver's, and the log says so.
    """
    from jitckpt.runtime.protected_state import Protected, is_zero

    rt = _get_runtime()
    if rt.snapshots is not None and num_shards != 1:
        raise ValueError(f"protect(num_shards={num_shards}): in-memory snapshots (--snapshot-every) "
                         "assume pure data parallelism (every rank holds the whole state); turn them "
                         "off for model-parallel jobs")
    if is_zero(optimizer) and rt.snapshots is not None:
        _check_zero_job(rt)
    snapshots, unmapped = rt.snapshots, None
    if num_shards == 1 and not is_zero(optimizer):
        from jitckpt.runtime.ddp_groups import DdpGroupError, ddp_shards

        try:
            found = ddp_shards(model)
        except DdpGroupError as e:
            found, unmapped = None, f"{e}. The job trains as under torchrun; a failure restarts it from step 0"
        if found is not None:
            import logging

            shard_id, num_shards = found
            rt.step_sync = _step_sync()
            if snapshots is not None and rt.rank == 0:
                logging.getLogger("jitckpt.protect").warning(
                    "jitckpt run --snapshot-every: ranks holding different states (%d: pipeline stages) are not "
                    "snapshotted in memory; a lost rank's state comes back from the ranks holding the same", num_shards)
            if num_shards == rt.world_size and not rt.periodic_every and rt.rank == 0:
                logging.getLogger("jitckpt.protect").warning(
                    "jitckpt.protect(): each of the %d ranks holds a state no other rank holds (pipeline stages without "
                    "data parallelism): after a lost rank its state exists nowhere else, so the job restarts from "
                    "step 0 (a preemption still saves every rank's). Run with --periodic-every N to lose at most N "
                    "steps, or give each stage data-parallel replicas (DDP over each stage's group)", num_shards)
            snapshots = None  # the replicated tier holds whole replicas only
    state = Protected(model, optimizer, scheduler, extra=extra, snapshots=snapshots, dataloader=dataloader)
    if unmapped is not None:
        state.unsupported = unmapped
    if state.unsupported is not None:
        # Never a crash of a job that runs under torchrun: no save function, so a failure gives up
        # the JIT save at once, saying why, and the launcher restarts the job from step 0.
        rt.no_save_reason = state.unsupported
        if rt.rank == 0:
            import logging

            logging.getLogger("jitckpt.protect").warning("%s", state.unsupported)
        return state
    if state.sharded is not None:
        pos = state.sharded.position
        rt.set_save_fn(state.save, step_fn=lambda: state.step, shard_id=pos.shard_id,
                       num_shards=pos.num_shards, replica_id=pos.replica_id)
        rt.saveable_while_running = state.untouched_mid_minibatch
        rt.part_fn = state.sharded.select_part
        rt.replica_ranks = pos.replica_ranks
        rt.preempt_at_boundary = True  # every rank's shard of one step
        rt.watch_functional_collectives()
        if rt.rank == 0:
            _warn_sharded_coverage(rt, pos)
    elif state.uses_aor:
        # A shard per rank, saved at a preemption and with --periodic-every, never after a failure:
        # a lost rank's partition exists only in the keepers (AOR), the survivors' shards would be
        # an incomplete set.
        import torch.distributed as dist

        init(state.save, step_fn=lambda: state.step, shard_id=dist.get_rank(), num_shards=dist.get_world_size())
        rt.no_save_reason = ("ZeroRedundancyOptimizer job: no JIT checkpoint after a failure (a lost rank's "
                             "optimizer partition exists only in the in-memory snapshots); the job resumes "
                             "from the newest snapshot")
        rt.save_to_memory = state.save_partition_now
    else:
        init(state.save, step_fn=lambda: state.step, shard_id=shard_id, num_shards=num_shards)
        rt.saveable_while_running = state.untouched_mid_minibatch
    rt.consistency_check = state.consistent_now
    for plugin in rt.plugins:
        plugin.on_protect(state, rt)
    return state


def _step_sync() -> Callable[[], None]:
    """One small all-reduce of every rank (on its own gloo group) before each optimizer step.

    Pipeline stages in DDP over their own groups do not wait on each other once the activations'
    gradients are sent: stage 1 could step to the next minibatch while stage 0, its gradient
    lost with a failed rank, cannot, and then no step has every stage's state. With this sync no
    rank steps before every rank is done with the minibatch's backward (Megatron's grad-norm
    all-reduce couples the stages the same way)."""
    import torch
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    one = torch.zeros(1)
    return lambda: dist.all_reduce(one, group=group)


def _warn_sharded_coverage(rt: "WorkerRuntime", pos: Any) -> None:
    """What a DTensor job's layout recovers from, said once at its start."""
    import logging

    from jitckpt.runtime.sharded_state import replicas_of

    log = logging.getLogger("jitckpt.protect")
    snaps = rt.snapshots
    if snaps is not None and snaps.flush_every:
        log.warning("jitckpt run --snapshot-flush-every: a DTensor job's shard snapshots stay in the keepers "
                    "(mesh %s); use --periodic-every N for shards on disk", pos.mesh)
    if snaps is not None and rt.world_size > snaps.ranks_per_node and snaps.protection == "none":
        log.warning("jitckpt run --snapshot-protection none: each node's keeper holds its own ranks' DTensor "
                    "shards only (mesh %s); a lost node's shards come back only from replicas on other nodes "
                    "(HSDP's replicate dimension across nodes), or from disk (--periodic-every N); "
                    "--snapshot-protection arc keeps a copy of each on the next node", pos.mesh)
    elif snaps is not None and snaps.protection == "aec" and rt.world_size == 2 * snaps.ranks_per_node:
        log.info("jitckpt run --snapshot-protection aec on 2 nodes: the XOR parity of a DTensor shard would be "
                 "the other node's shard itself, so each is copied to the other node (as arc; mesh %s)", pos.mesh)
    if replicas_of(pos, rt.world_size) < 2 and not rt.periodic_every and snaps is None:
        log.warning("jitckpt.protect(): mesh %s keeps each shard on one rank only (no replica): after a "
                    "lost rank its shard exists nowhere else, so the job restarts from step 0 (a "
                    "preemption still saves every shard). Run with --snapshot-every 1 (each rank's shard in its "
                    "node's keeper: at most the failed minibatch is lost), add a replicate dimension (HSDP), "
                    "or run with --periodic-every N to lose at most N steps", pos.mesh)


def _check_zero_job(rt: "WorkerRuntime") -> None:
    if rt.snapshots.flush_every:
        raise ValueError("protect(optimizer=ZeroRedundancyOptimizer): --snapshot-flush-every writes the "
                         "parameters without the optimizer partitions, which a ZeRO job cannot resume from; "
                         "use --periodic-every N instead (every rank saves its own shard, its partition "
                         "included)")
