"""What an integration needs of ``jitckpt run`` before it takes over a framework's checkpoints."""
from __future__ import annotations


def require_jit_checkpoints(framework: str, layout: str) -> None:
    """ValueError if this job runs with ``--snapshot-every``: the in-memory tier restores jitckpt's
    own format, which ``framework`` cannot resume from (its JIT checkpoints are ``layout``)."""
    from jitckpt.runtime.current import get_runtime

    if get_runtime().snapshots is not None:
        raise ValueError(f"jitckpt JitCheckpointCallback: jitckpt run --snapshot-every keeps snapshots in jitckpt's "
                         f"own format, which {framework} cannot resume from; run without it (the JIT checkpoint "
                         f"after a failure is {layout})")
