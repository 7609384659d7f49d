"""The in-memory snapshot tier (REFT): asynchronous snapshots held by a keeper per node.

Save path: :mod:`.tier` (inside a worker) -> :mod:`.layout` (the state as one byte space) ->
:mod:`.protection` (which bytes each rank keeps: ARC replicas or AEC XOR parity) ->
:mod:`.client` (asynchronous copy into the keeper) -> :mod:`.keeper` (a process per node that owns
the memory; :mod:`.keeper_client` is a rank's connection to it), with :mod:`.checksum` over every
object. Restore path: :mod:`.restore` (newest usable snapshot or disk checkpoint, decoding a lost
node's bytes). ZeRO-1 optimizer partitions: :mod:`.aor` and :mod:`.aor_store` (REFT's AOR).
DTensor shards (FSDP2, TP): :mod:`.shard_snapshots`, each rank's own shard, keys in :mod:`.shard_keys`.
"""
