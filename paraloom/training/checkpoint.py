"""Checkpoints with ``torch.distributed.checkpoint`` under global, layout-independent names.

Every saved tensor is a DTensor on the run's ``(pp, dp, cp, tp)`` device mesh: a tensor-parallel
parameter is ``Shard(partition_dim)`` over tp and replicated over dp and cp; everything else is
replicated. Names are the model's global names (``layers.7.mlp.fc1.weight``), so a checkpoint
written under one (tp, pp, dp) loads under another: DCP reads, for each rank, just the slices its
own shards need.

Safety and atomicity:

* A save writes into ``step_N.tmp``; after every rank has finished, rank 0 renames it to
  ``step_N`` (``rename`` is atomic), so a crash mid-save leaves the previous checkpoint intact and
  :func:`latest_checkpoint` never returns a half-written one.
* Loading never unpickles arbitrary objects: tensors are read with ``weights_only=True`` by DCP,
  and DCP's pickled ``.metadata`` is read by a restricted unpickler that admits only DCP's own
  metadata classes and plain values. Non-tensor state (step, config) lives in ``meta.json``.

What belongs to one rank only (its dropout RNG streams) is not a global tensor: each rank writes
it to ``rank/rank_N.pt`` in the same folder (plain tensors, loaded with ``weights_only=True``); it
is restored only under the same (tp, pp, dp) layout.

DCP and the device mesh coordinate through ``torch.distributed`` themselves; that is the one
communication outside ``comm.py`` (checkpoint I/O, not training), and it is not in the ledger.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

__all__ = ["Entry", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "read_meta",
           "find_checkpoint", "FORMAT", "SafeFileSystemReader", "read_rank_state", "run_folder"]

FORMAT = "paraloom-checkpoint-1"
"""``meta.json``'s ``format``: what marks a folder as a paraloom checkpoint."""


@dataclass
class Entry:
    """One tensor to save or fill: this rank's local part and how it splits over tp."""

    tensor: torch.Tensor
    """Local data (the tp shard); on load it is overwritten in place."""
    partition_dim: int | None = None
    """Dimension split over the tp group, or ``None`` when every tp rank holds the full tensor."""
    vocab_rows: int | None = None
    """For a vocabulary table (rows = padded vocabulary, split on dim 0): the real vocabulary.
    Its padding depends on tp (Megatron-LM's rule), so a checkpoint written under another tp may
    hold more or fewer rows: the real rows are loaded, this layout's padding rows are kept."""


_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
     ("torch.distributed.checkpoint.planner", "LoadItemType"),
     ("torch.distributed.checkpoint.planner", "WriteItemType"),
     ("torch", "Size"), ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"),
     ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"), ("torch", "bool"),
     ("torch", "float64"), ("torch", "strided"), ("torch", "contiguous_format"),
     ("torch", "preserve_format"), ("collections", "OrderedDict"), ("builtins", "set"),
     ("builtins", "frozenset"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}
"""Everything DCP's metadata pickle may name: its own dataclasses and enums, torch sizes, dtypes
and layouts, and paths. Anything else (a function to call, a class with side effects) is refused."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or module == "torch.distributed.checkpoint.metadata":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is "
                                     f"not checkpoint metadata; refusing to load it")


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader with the metadata read by a restricted unpickler (no code execution)."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _RestrictedUnpickler(io.BytesIO(f.read())).load()
        from torch.distributed.checkpoint.metadata import StorageMeta
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _device_mesh(mesh):
    """The DeviceMesh matching ``mesh`` (built once; every rank must call this together)."""
    cached = getattr(mesh, "_device_mesh", None)
    if cached is None:
        from torch.distributed.device_mesh import init_device_mesh
        c = mesh.config
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        cp = getattr(c, "cp", 1)  # every tensor is replicated over cp, as over dp
        cached = init_device_mesh(device, (c.pp, c.dp, cp, c.tp),
                                  mesh_dim_names=("pp", "dp", "cp", "tp"))
        mesh._device_mesh = cached
    return cached["dp", "cp", "tp"]


def _dtensors(entries: dict[str, Entry], mesh) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    sub = _device_mesh(mesh)
    out = {}
    for name, e in entries.items():
        tp = Shard(e.partition_dim) if e.partition_dim is not None else Replicate()
        out[name] = DTensor.from_local(e.tensor, sub, [Replicate(), Replicate(), tp],
                                       run_check=False)
    return out


def save_checkpoint(directory: str | Path, entries: dict[str, Entry], meta: dict, mesh,
                    rank_state: dict | None = None) -> Path:
    """Write ``entries`` (and JSON ``meta``) to ``directory`` atomically; returns the directory.

    ``rank_state``: this rank's own state that no other rank has (its RNG streams), written to
    ``rank/rank_N.pt`` (tensors and plain values only, read back with ``weights_only=True``).
    It is written before DCP's save, whose final gather to rank 0 then orders it before the
    rename."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    if rank_state is not None:
        (tmp / "rank").mkdir(exist_ok=True)
        torch.save(rank_state, tmp / "rank" / f"rank_{dist.get_rank()}.pt")
    dcp.save(_dtensors(entries, mesh), checkpoint_id=str(tmp))
    if dist.get_rank() == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    dist.barrier()
    return directory


def read_meta(directory: str | Path) -> dict:
    """The JSON metadata of a complete checkpoint folder (clear error if it is not one)."""
    directory = Path(directory)
    meta = directory / "meta.json"
    if not (directory / ".metadata").is_file() or not meta.is_file():
        raise ValueError(f"{str(directory)!r} is not a complete paraloom checkpoint "
                         f"(missing .metadata or meta.json)")
    try:
        return json.loads(meta.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(meta)!r} is not valid JSON: {err}") from None


def load_checkpoint(directory: str | Path, entries: dict[str, Entry], mesh) -> dict:
    """Fill ``entries`` in place from ``directory``; returns its metadata.

    Every name in ``entries`` must be in the checkpoint with the same global shape, except a
    vocabulary table (``Entry.vocab_rows``) padded to another number of rows: its real rows are
    read whole on every rank and this rank's range copied (:func:`_load_rows`).
    """
    meta = read_meta(directory)
    reader = SafeFileSystemReader(str(directory))
    saved = reader.read_metadata().state_dict_metadata
    state = _dtensors(entries, mesh)
    repadded = {name: e for name, e in entries.items()
                if e.vocab_rows is not None and name in saved
                and tuple(saved[name].size) != tuple(state[name].shape)}
    for name in repadded:
        state[name] = _replicated(saved[name].size, entries[name].tensor, mesh)
    dcp.load(state, storage_reader=reader)
    for name, e in entries.items():  # DCP fills the DTensors' local shards: copy back if needed
        local = state[name].to_local()
        if name in repadded:
            _load_rows(e, local, mesh)
        elif local.data_ptr() != e.tensor.data_ptr():
            e.tensor.copy_(local)
    return meta


def _replicated(size, like: torch.Tensor, mesh):
    """An empty DTensor of the checkpoint's global ``size``, whole on every rank."""
    from torch.distributed.tensor import DTensor, Replicate
    full = torch.zeros(tuple(size), dtype=like.dtype, device=like.device)
    return DTensor.from_local(full, _device_mesh(mesh), [Replicate()] * 3, run_check=False)


def _load_rows(e: Entry, full: torch.Tensor, mesh) -> None:
    """Copy the real vocabulary rows of this rank's range from the whole saved table."""
    rows = e.tensor.shape[0]
    start = _device_mesh(mesh).get_local_rank("tp") * rows
    stop = min(start + rows, e.vocab_rows, full.shape[0])
    if stop > start:
        e.tensor[: stop - start].copy_(full[start:stop])


def read_rank_state(directory: str | Path, rank: int) -> dict | None:
    """What :func:`save_checkpoint` stored for ``rank`` (``None`` if nothing: an older checkpoint,
    or a rank the writing layout did not have). Plain data only: ``weights_only=True``."""
    path = Path(directory) / "rank" / f"rank_{rank}.pt"
    return torch.load(path, weights_only=True) if path.is_file() else None


def run_folder(ckpt: str | Path) -> Path | None:
    """The run folder a ``.../checkpoints/step_N`` folder belongs to (``None`` for a checkpoint
    folder that is not in a run's ``checkpoints/``)."""
    ckpt = Path(ckpt)
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None


def find_checkpoint(path: str | Path, flag: str = "--resume") -> tuple[Path, dict]:
    """The newest complete paraloom checkpoint under ``path`` and its metadata, or a
    ``ValueError`` that names ``flag`` and ``path`` (none there, or not paraloom's)."""
    if not Path(path).exists():
        raise ValueError(f"{flag} {str(path)!r} does not exist (give a run folder, its "
                         f"checkpoints/ or a checkpoints/step_N folder)")
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise ValueError(f"{flag} {str(path)!r}: no complete paraloom checkpoint there "
                         f"(expected checkpoints/step_N/ with .metadata and meta.json)")
    meta = read_meta(ckpt)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{flag} {str(ckpt)!r} is not a paraloom checkpoint")
    return ckpt, meta


def latest_checkpoint(path: str | Path) -> Path | None:
    """The newest complete ``step_N`` folder under ``path`` (a run folder, its ``checkpoints/``,
    or a checkpoint folder itself); ``None`` if there is none."""
    path = Path(path)
    if (path / ".metadata").is_file() and (path / "meta.json").is_file():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not root.is_dir():
        return None
    steps = []
    for child in root.iterdir():
        name = child.name
        if name.startswith("step_") and name[5:].isdigit() and (child / "meta.json").is_file() \
                and (child / ".metadata").is_file():
            steps.append((int(name[5:]), child))
    return max(steps)[1] if steps else None
