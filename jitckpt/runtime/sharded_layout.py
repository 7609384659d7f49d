"""Whether a model's state is DTensor-sharded or -replicated over a DeviceMesh (FSDP2, HSDP, tensor
parallel), which ``protect()`` cannot JIT-save yet (issue 44)."""
from __future__ import annotations

import itertools
import sys
from typing import Any, Optional


def dtensor_layout(model: Any) -> Optional[str]:
    """One line naming the meshes and placements of the model's DTensor parameters and buffers,
    e.g. ``"mesh (2, 2) ('replicate', 'shard'): (Replicate(), Shard(dim=0))"``; None when every
    one is a plain tensor."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:  # not imported: no DTensor exists (and DDP jobs do not pay for the import)
        return None
    seen: dict = {}
    for _, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if isinstance(t, module.DTensor):
            mesh = t.device_mesh
            key = (tuple(mesh.mesh.shape), mesh.mesh_dim_names)
            seen.setdefault(key, set()).add("(" + ", ".join(repr(p) for p in t.placements) + ")")
    if not seen:
        return None
    return "; ".join(f"mesh {shape}{'' if names is None else ' ' + str(tuple(names))}: {', '.join(sorted(places))}"
                     for (shape, names), places in seen.items())
