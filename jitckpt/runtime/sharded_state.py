"""The DTensor state of a protected model (FSDP2, HSDP, tensor parallel) as ``torch.distributed.checkpoint``
shards: each rank writes its own without a collective, a restore reads one copy of every shard.

A rank's *shard* is its coordinate on the mesh dimensions some tensor is sharded over; the ranks
that differ only on the other (replicated) dimensions hold the same bytes, so one copy of each
shard makes a complete checkpoint: HSDP's replica group is what a lost rank's shard comes back
from. Each rank's checkpoint directory holds a DCP checkpoint of its own chunks (``dcp/``, written
with ``no_dist``: no collective, so a survivor can write it while a peer is gone) and the chunks'
DCP metadata as JSON (``dcp-chunks.json``). A restore merges one copy of every shard into one DCP
metadata in memory (no pickle is read) and loads it with ``torch.distributed.checkpoint.load``,
which reshards to the job's mesh; :func:`export_dcp` writes the same as a plain DCP directory.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

CHUNKS_FILE = "dcp-chunks.json"
DCP_DIR = "dcp"


class UnmappableLayout(TypeError):
    """A model or optimizer whose DTensor layout jitckpt cannot map to shards and replicas."""


@dataclass(frozen=True)
class ShardPosition:
    """Where this rank's state sits: shard ``shard_id`` of ``num_shards``, replica ``replica_id``."""

    shard_id: int
    num_shards: int
    replica_id: int
    mesh: str  # e.g. "(2, 2) ('replicate', 'shard'), sharded over ('shard',)", for messages
    stage: Optional[int] = None  # the coordinate on mesh dimensions no tensor is on (pipeline stages)
    replica_ranks: tuple = ()  # the global rank of each replica of this shard, by replica id

    @property
    def key_prefix(self) -> str:
        """What this rank's tensor names get in the DCP shards: stages' names may coincide."""
        return "" if self.stage is None else f"stage{self.stage}."


def replicas_of(pos: ShardPosition, world_size: int) -> int:
    """How many ranks hold each shard."""
    return world_size // pos.num_shards


def _ravel(coords: list, sizes: list) -> int:
    out = 0
    for c, n in zip(coords, sizes):
        out = out * n + c
    return out


def _root_dims(t: Any, name: str) -> tuple[Any, list]:
    """The root mesh of DTensor ``t`` and, for each of its mesh's dimensions, the root's dimension
    (a sub-mesh such as ``mesh["dp"]`` maps by dimension name)."""
    mesh = t.device_mesh
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root is mesh or root is None:
        return mesh, list(range(mesh.ndim))
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if names is None or root_names is None or any(n not in root_names for n in names):
        raise UnmappableLayout(
            f"jitckpt.protect(): tensor {name!r} is on a sub-mesh {names} of mesh {root_names} whose "
            "dimensions jitckpt cannot map by name (flattened or unnamed dimensions); give every mesh "
            "dimension a name (init_device_mesh(..., mesh_dim_names=...)) and slice sub-meshes by name")
    return root, [root_names.index(n) for n in names]


def shard_position(tensors: dict, *, world_size: int) -> ShardPosition:
    """This rank's shard and replica for the DTensors in ``tensors`` (name -> tensor). Every
    DTensor must live on one mesh spanning the whole job or on its named sub-meshes (FSDP2 + TP);
    raises :class:`UnmappableLayout` naming the first tensor that does not."""
    from torch.distributed.tensor import DTensor

    mesh, first = None, None
    sharded: set = set()
    covered: set = set()  # root dimensions some tensor's mesh has
    for name, t in tensors.items():
        if not isinstance(t, DTensor):
            continue  # a plain tensor: the same on every rank (FSDP2's buffers, TP's unparallelized layers)
        root, dims = _root_dims(t, name)
        covered.update(dims)
        if mesh is None:
            mesh, first = root, name
        elif root != mesh:
            raise UnmappableLayout(
                f"jitckpt.protect(): tensor {name!r} is on mesh {tuple(root.mesh.shape)} "
                f"{root.mesh_dim_names}, tensor {first!r} on {tuple(mesh.mesh.shape)} "
                f"{mesh.mesh_dim_names}; jitckpt maps a model on one DeviceMesh (and its sub-meshes) "
                "only, not pipeline stages on separate meshes yet. Put every parameter on one mesh, "
                "or leave the job to torchrun")
        sharded.update(dims[i] for i, p in enumerate(t.placements) if p.is_shard())
    assert mesh is not None, "shard_position() needs at least one DTensor"
    if mesh.size() != world_size:
        raise UnmappableLayout(
            f"jitckpt.protect(): tensor {first!r} is on a mesh of {mesh.size()} ranks, the job has "
            f"{world_size}; jitckpt maps a mesh spanning the whole job only")
    coords = mesh.get_coordinate()
    sizes = list(mesh.mesh.shape)
    # A dimension no tensor is on (pipeline stages: each stage's module on mesh["dp"]) holds other
    # tensors at each coordinate, not replicas: it counts as sharded.
    stages = [i for i in range(len(sizes)) if i not in covered]
    dims = sorted(sharded | set(stages))
    rest = [i for i in range(len(sizes)) if i not in dims]
    names = mesh.mesh_dim_names
    mine = _ravel([coords[i] for i in dims], [sizes[i] for i in dims])
    holders = {}  # replica id -> global rank, of the ranks that hold this shard
    for at in itertools.product(*(range(n) for n in sizes)):
        if _ravel([at[i] for i in dims], [sizes[i] for i in dims]) == mine:
            holders[_ravel([at[i] for i in rest], [sizes[i] for i in rest])] = int(mesh.mesh[at])
    return ShardPosition(
        shard_id=mine,
        num_shards=math.prod(sizes[i] for i in dims),
        replica_id=_ravel([coords[i] for i in rest], [sizes[i] for i in rest]),
        mesh=f"{tuple(sizes)}{'' if names is None else ' ' + str(tuple(names))}, sharded over "
             f"{tuple(names[i] for i in dims) if names else tuple(dims)}"
             + (f" (stages over {tuple(names[i] for i in stages) if names else tuple(stages)})" if stages else ""),
        stage=_ravel([coords[i] for i in stages], [sizes[i] for i in stages]) if stages else None,
        replica_ranks=tuple(holders[r] for r in sorted(holders)))


# ---- DCP metadata as JSON, both ways -----------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def chunks_to_json(md: Any) -> dict:
    """The parts of a DCP ``Metadata`` a merge needs, as JSON (tensors only)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {}
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            raise UnmappableLayout(f"jitckpt: {fqn!r} is not a tensor; only tensors go into the DCP shards")
        tensors[fqn] = {"dtype": _dtype_name(m.properties.dtype), "size": list(m.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
    storage = [[idx.fqn, list(idx.offset), info.relative_path, info.offset, info.length]
               for idx, info in md.storage_data.items()]
    return {"tensors": tensors, "storage": storage, "planner_data": {k: list(v) for k, v in (md.planner_data or {}).items()}}


def merge_chunks(copies: dict[int, tuple[str, dict]]) -> Any:
    """One DCP ``Metadata`` over one copy of every shard: ``copies`` maps shard id -> (the copy's
    directory relative to the reader's root, its :func:`chunks_to_json`). A chunk that several
    shards hold (a replicated tensor) is read from the lowest shard's copy."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    tensors: dict = {}
    storage: dict = {}
    planner: dict = {}
    for shard in sorted(copies):
        rel, doc = copies[shard]
        for fqn, t in doc["tensors"].items():
            m = tensors.get(fqn)
            if m is None:
                m = tensors[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=getattr(torch, t["dtype"])),
                    size=torch.Size(t["size"]), chunks=[])
            elif list(m.size) != t["size"]:
                raise UnmappableLayout(f"jitckpt: the shards disagree on the size of {fqn!r}: "
                                       f"{list(m.size)} and {t['size']} (not one checkpoint)")
            have = {tuple(c.offsets) for c in m.chunks}
            for offsets, sizes in t["chunks"]:
                if tuple(offsets) not in have:
                    m.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        for fqn, offset, path, off, length in doc["storage"]:
            key = MetadataIndex(fqn, torch.Size(offset))
            if key not in storage:
                storage[key] = _StorageInfo(relative_path=f"{rel}/{path}" if rel else path, offset=off, length=length)
        planner.update({k: tuple(v) for k, v in doc["planner_data"].items()})
    return Metadata(state_dict_metadata=tensors, planner_data=planner, storage_data=storage)


def _reader(root: Path, md: Any) -> Any:
    """A DCP FileSystemReader of ``root`` whose metadata is ``md`` (built here, not unpickled)."""
    from torch.distributed.checkpoint import FileSystemReader

    class MergedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return md

    return MergedReader(str(root))


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def balanced_parts(sizes: dict, count: int) -> list:
    """``count`` lists of the keys of ``sizes`` (key -> bytes) of about equal bytes: largest first,
    each to the lightest list so far (ties: the first key, the first list). The replicas of a shard
    hold the same keys and sizes, so each computes the same parts."""
    parts: list = [[] for _ in range(count)]
    load = [0] * count
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        i = min(range(count), key=lambda j: (load[j], j))
        parts[i].append(key)
        load[i] += sizes[key]
    return parts


# ---- the state -----------------------------------------------------------------------------
class ShardedState:
    """The model's and optimizer's tensors of a DTensor-sharded job, captured at ``protect()``.

    The objects are taken once, on the training thread, from ``model.state_dict(keep_vars=True)``:
    FSDP2's sharded parameters stay the same objects for the whole job, while calling
    ``state_dict()`` later (another thread, mid forward) would reshard the live module."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, world_size: int) -> None:
        self.tensors = dict(model.state_dict(keep_vars=True))
        self.position = shard_position(self.tensors, world_size=world_size)
        self.world_size = world_size
        self.part: Optional[tuple[int, int]] = None  # (replica, replicas): this write's share, or whole
        fqn_of = {id(p): n for n, p in model.named_parameters()}
        self.param_names: list = []  # the optimizer's parameters in its own order, by name
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in fqn_of:
                    raise UnmappableLayout(
                        f"jitckpt.protect(): the optimizer's parameter {pi} of group {gi} (shape "
                        f"{tuple(p.shape)}) is not a parameter of the model, so its state has no name "
                        "to be saved under; build the optimizer from model.parameters() after "
                        "fully_shard()/parallelize_module()")
                self.param_names.append(fqn_of[id(p)])
        self.optimizer = optimizer

    def select_part(self, replica: int) -> tuple[int, int]:
        """Choose what the next write holds, replica ``replica``'s part of this rank's shard, and
        return its (shard id, shard count) for the checkpoint store. The ``R`` replicas of a shard
        each hold every R-th of its tensors (as DCP spreads replicated chunks), so a save with every
        rank alive costs each rank 1/R of its shard; after a failure a survivor also writes the
        parts of replicas that do not write theirs (:mod:`jitckpt.runtime.shard_parts`). Without
        replicas, the whole shard."""
        pos = self.position
        replicas = replicas_of(pos, self.world_size)
        self.part = (replica, replicas) if replicas > 1 else None
        if self.part is None:
            return pos.shard_id, pos.num_shards
        return pos.shard_id * replicas + replica, pos.num_shards * replicas

    def tensor_state(self, buffers: Optional[dict]) -> tuple[dict, dict]:
        """``{"model": {name: tensor}, "optim": {param: {key: tensor}}}`` as now (``buffers``: a
        copy of the buffers to save instead of the live ones), and the optimizer's non-tensor state;
        only this write's part (:meth:`select_part`)."""
        pre = self.position.key_prefix
        model = {pre + k: (buffers[k] if buffers and k in buffers else v).detach() for k, v in self.tensors.items()}
        optim: dict = {}
        other: dict = {}
        by_id = {id(p): n for n, p in zip(self.param_names, self._params())}
        for p, st in self.optimizer.state.items():
            name = by_id[id(p)]
            optim[pre + name] = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
            other[name] = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
        if self.part is not None:
            index, count = self.part
            sizes = {("model", k): _local_bytes(v) for k, v in model.items()}
            sizes.update({("optim", n, k): _local_bytes(v) for n, st in optim.items() for k, v in st.items()})
            mine = set(balanced_parts(sizes, count)[index])
            model = {k: v for k, v in model.items() if ("model", k) in mine}
            optim = {n: {k: v for k, v in st.items() if ("optim", n, k) in mine} for n, st in optim.items()}
            optim = {n: st for n, st in optim.items() if st}
        return {"model": model, "optim": optim}, other

    def _params(self) -> list:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def param_groups(self) -> list:
        """The optimizer's hyperparameters, each group's parameters by name."""
        out, i = [], 0
        for g in self.optimizer.param_groups:
            n = len(g["params"])
            out.append({**{k: v for k, v in g.items() if k != "params"}, "params": self.param_names[i:i + n]})
            i += n
        return out

    @staticmethod
    def write(directory: str, tensors: dict) -> None:
        """This rank's chunks into ``directory`` (no collective): ``dcp/`` and ``dcp-chunks.json``."""
        import torch.distributed.checkpoint as dcp

        # no_dist is the point here (no collective), not a sign of a missing process group.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        # Files are fsynced and checksummed by the checkpoint store, which commits the directory.
        class Writer(dcp.FileSystemWriter):
            """Keeps where each chunk went (what ``finish`` records in the metadata file): torch
            2.11's and 2.12's ``dcp.save`` return the metadata without it (finish completes a copy)."""

            def finish(self, metadata: Any, results: list) -> None:
                self.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
                super().finish(metadata, results)

        writer = Writer(os.path.join(directory, DCP_DIR), sync_files=False)
        md = dcp.save(tensors, storage_writer=writer, no_dist=True)
        md.storage_data = writer.storage_data
        with open(os.path.join(directory, CHUNKS_FILE), "w") as f:
            json.dump(chunks_to_json(md), f)

    def load(self, root: Path, copies: dict[int, str], other: dict, groups: list) -> None:
        """Load one copy of every shard (``copies``: shard id -> directory name under ``root``)
        into the live tensors and the optimizer. Collective: every rank calls it."""
        import torch.distributed.checkpoint as dcp

        md = merge_chunks({s: (f"{name}/{DCP_DIR}", json.loads((root / name / CHUNKS_FILE).read_text()))
                           for s, name in copies.items()})
        pre = self.position.key_prefix
        target = {"model": {pre + k: v.detach() for k, v in self.tensors.items()}, "optim": {}}
        params = {pre + n: p for n, p in zip(self.param_names, self._params())}
        missing = [k for k in target["model"] if f"model.{k}" not in md.state_dict_metadata]
        if missing:
            raise UnmappableLayout(f"jitckpt resume: the checkpoint in {root} has no {missing[0]!r} (of "
                                   f"{len(missing)} tensors missing): it is not of this model. Resume it "
                                   "with the model that wrote it, or give this job another --checkpoint-dir")
        for k, v in target["model"].items():
            saved = list(md.state_dict_metadata[f"model.{k}"].size)
            if saved != list(v.shape):  # DCP reshards a layout, not a tensor of another shape
                raise UnmappableLayout(
                    f"jitckpt resume: tensor {k!r} is {saved} in the checkpoint in {root}, {list(v.shape)} in "
                    "this model: it is another model's checkpoint. Resume it with the model that wrote it, "
                    "or give this job another --checkpoint-dir")
        for key, m in md.state_dict_metadata.items():
            if not key.startswith(f"optim.{pre}"):
                continue  # (with stages: another stage's)
            name, _, k = key[len("optim."):].rpartition(".")
            p = params.get(name)
            if p is None:
                raise UnmappableLayout(f"jitckpt resume: the checkpoint has optimizer state for {name!r}, "
                                       "which this optimizer does not hold")
            like = p.detach()
            if list(m.size) == list(like.shape):  # the parameter's layout (Adam's moments)
                t = torch.zeros_like(like, dtype=m.properties.dtype)
            else:  # e.g. Adam's step counter: a plain tensor, whole on every rank
                t = torch.zeros(m.size, dtype=m.properties.dtype)
            target["optim"].setdefault(name, {})[k] = t
        dcp.load(target, storage_reader=_reader(root, md))
        self._load_optimizer({n[len(pre):]: st for n, st in target["optim"].items()}, other, groups)

    def _load_optimizer(self, tensors: dict, other: dict, groups: list) -> None:
        """``optimizer.load_state_dict`` of state by parameter name (``tensors``: name -> {key: tensor},
        ``other``: its non-tensor state) and hyperparameters ``groups`` (parameters by name)."""
        index = {n: i for i, n in enumerate(self.param_names)}
        state = {index[n]: dict(st) for n, st in tensors.items()}
        for n, st in other.items():  # non-tensor state, also of parameters with no tensor state
            if st and n in index:
                state.setdefault(index[n], {}).update(st)
        saved_groups = []
        for g in groups:
            try:
                saved_groups.append({**g, "params": [index[n] for n in g["params"]]})
            except KeyError as e:
                raise UnmappableLayout(f"jitckpt resume: the checkpoint's optimizer holds {e.args[0]!r}, "
                                       "which this optimizer does not") from None
        self.optimizer.load_state_dict({"state": state, "param_groups": saved_groups})

    # ---- this rank's shard as plain tensors (the in-memory tier: jitckpt.snapshot.shard_snapshots)
    def local_state(self) -> dict:
        """This rank's whole shard as plain tensors (each DTensor's local part, no copy): ``model``,
        ``optim`` (by parameter name), ``dtensor`` (the ``[name, key]`` optimizer entries that are
        DTensors), ``optim_other`` and ``param_groups``."""
        model = {k: _local(v.detach()) for k, v in self.tensors.items()}
        optim: dict = {}
        other: dict = {}
        dtensor: list = []
        by_id = {id(p): n for n, p in zip(self.param_names, self._params())}
        for p, st in self.optimizer.state.items():
            name = by_id[id(p)]
            optim[name] = {}
            other[name] = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    optim[name][k] = _local(v.detach())
                    if hasattr(v, "to_local"):
                        dtensor.append([name, k])
                else:
                    other[name][k] = v
        return {"model": model, "optim": optim, "dtensor": dtensor, "optim_other": other,
                "param_groups": self.param_groups()}

    def load_local(self, saved: dict, *, source: str) -> None:
        """Load :meth:`local_state` as saved (on this mesh, by this rank's shard) into the live
        tensors and the optimizer. ``source`` names where it came from, for errors."""
        from torch.distributed.tensor import DTensor

        model = saved["model"]
        if set(model) != set(self.tensors):
            odd = sorted(set(model) ^ set(self.tensors))
            raise UnmappableLayout(f"jitckpt resume: {source} has other tensors than this model ({odd[0]!r} "
                                   "differs): it is not of this model")
        for k, live in self.tensors.items():
            dst, src = _local(live.detach()), model[k]
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise UnmappableLayout(f"jitckpt resume: tensor {k!r} is {list(src.shape)} {src.dtype} in {source}, "
                                       f"{list(dst.shape)} {dst.dtype} here: it is not of this model")
            dst.copy_(src)
        params = dict(zip(self.param_names, self._params()))
        wrap = {(n, k) for n, k in saved["dtensor"]}
        tensors: dict = {}
        for name, st in saved["optim"].items():
            p = params.get(name)
            if p is None:
                raise UnmappableLayout(f"jitckpt resume: {source} has optimizer state for {name!r}, which "
                                       "this optimizer does not hold")
            for k, t in st.items():
                t = t.clone()  # private: load_state_dict keeps what it is given
                if (name, k) in wrap:
                    t = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
                tensors.setdefault(name, {})[k] = t
        self._load_optimizer(tensors, saved["optim_other"], saved["param_groups"])


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (no copy); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def own_copy(copies: dict[int, Path], pos: ShardPosition, world_size: int) -> Path:
    """The copy in a complete set (shard id -> directory) of this rank's shard, for its non-tensor
    state (each pipeline stage has its own): whole shards, or the parts its replicas split it
    into (:meth:`ShardedState.select_part`); shard 0's for a set of another mesh (DCP reshards it,
    and every shard has the same non-tensor state then)."""
    replicas = replicas_of(pos, world_size)
    if len(copies) == pos.num_shards:
        return copies[pos.shard_id]
    if len(copies) == pos.num_shards * replicas:
        return copies[pos.shard_id * replicas + pos.replica_id]
    return copies[0]


def newest_set(checkpoint_dir: str | os.PathLike) -> Optional[dict[int, Path]]:
    """One copy of every shard of the newest complete step under ``checkpoint_dir``: shard id ->
    its directory; None if there is none. CheckpointError if that set is not a DTensor job's."""
    from jitckpt.checkpoint_store import CheckpointError, find_complete_set

    root = Path(checkpoint_dir)
    found = find_complete_set(root)
    if found is None:
        return None
    plain = [p for p, _ in found.values() if not (p / CHUNKS_FILE).is_file()]
    if plain:
        raise CheckpointError(
            f"{plain[0]} was not written by a DTensor-sharded job (no {CHUNKS_FILE}): this job cannot "
            f"resume from it, nor is it a DCP checkpoint. Use another checkpoint directory, or remove {root}")
    return {s: p for s, (p, _) in found.items()}


def export_newest(checkpoint_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """The newest complete checkpoint of a DTensor job under ``checkpoint_dir`` as a plain DCP
    directory ``out`` (see :func:`export_dcp`); its keys are ``model.<name>`` and
    ``optim.<parameter name>.<state key>``. Raises CheckpointError if there is none."""
    from jitckpt.checkpoint_store import CheckpointError

    copies = newest_set(checkpoint_dir)
    if copies is None:
        raise CheckpointError(f"{checkpoint_dir} holds no complete checkpoint (every shard verified)")
    if Path(out).exists():
        raise CheckpointError(f"{out} exists; give a new directory")
    return export_dcp(checkpoint_dir, {s: p.name for s, p in copies.items()}, out)


def export_dcp(root: str | os.PathLike, copies: dict[int, str], out: str | os.PathLike) -> Path:
    """Write one copy of every shard (``copies``: shard id -> checkpoint directory name under
    ``root``) as a plain DCP checkpoint directory ``out`` (hard links to the shards' data, then
    ``.metadata``), loadable by ``torch.distributed.checkpoint.load`` with any mesh."""
    import pickle

    root, out = Path(root), Path(out)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    tmp.mkdir(parents=True)
    docs = {}
    def renamed(shard: int, file: str) -> str:  # every shard's no_dist save names its file __0_*
        return f"s{shard}-{file}"

    for shard, name in copies.items():
        for f in (root / name / DCP_DIR).glob("*.distcp"):
            os.link(f, tmp / renamed(shard, f.name))
        doc = json.loads((root / name / CHUNKS_FILE).read_text())
        for row in doc["storage"]:
            row[2] = renamed(shard, row[2])
        docs[shard] = ("", doc)
    md = merge_chunks(docs)
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    md.version = CURRENT_DCP_VERSION
    with open(tmp / ".metadata", "wb") as f:  # DCP's own format (a pickle), written last
        pickle.dump(md, f)
    os.rename(tmp, out)
    return out
