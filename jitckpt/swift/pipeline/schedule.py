"""Per-stage micro-batch schedules for synchronous pipeline training (1F1B and GPipe)."""
from __future__ import annotations

FORWARD, BACKWARD = "F", "B"


def pipeline_schedule(*, stage: int, num_stages: int, num_micro_batches: int,
                      kind: str = "1f1b") -> list[tuple[str, int]]:
    """Ordered ``(op, micro_batch)`` list for one stage; ``op`` is ``"F"`` or ``"B"``.

    ``"1f1b"`` (PipeDream-flush): ``num_stages - stage - 1`` warm-up forwards, then alternate
    one forward and one backward, then drain the backwards. ``"gpipe"``: all forwards, then
    all backwards. Backwards run in micro-batch order in both, so gradients accumulate in the
    same order every time (needed for bitwise replay).
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    m = num_micro_batches
    if kind == "gpipe":
        return [(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"unknown schedule {kind!r}: use '1f1b' or 'gpipe'")
    warm = min(num_stages - stage - 1, m)
    ops = [(FORWARD, i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        ops += [(FORWARD, f), (BACKWARD, b)]
        f, b = f + 1, b + 1
    ops += [(BACKWARD, i) for i in range(b, m)]
    return ops
