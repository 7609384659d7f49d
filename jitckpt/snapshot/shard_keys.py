"""Keeper object keys of DTensor shard snapshots (:mod:`jitckpt.snapshot.shard_snapshots`), without
torch: the launcher reads them from its keeper's listing (:mod:`jitckpt.launcher.keeper_coverage`)."""

PREFIX = "dt.r"


def shard_key(rank: int) -> str:
    """Keeper object key of rank ``rank``'s shard snapshot."""
    return f"{PREFIX}{rank}"


def parity_key(rank: int) -> str:
    """Keeper object key of the XOR parity rank ``rank`` keeps for its group (``--snapshot-protection aec``)."""
    return f"dtp.r{rank}"
