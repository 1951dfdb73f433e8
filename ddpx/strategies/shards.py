"""Sharded state, whatever the strategy: DTensors, and their checkpoint files.

A strategy whose ranks each hold a part of the model (``Strategy.replicated`` False:
fsdp's shards today) keeps its parameters as DTensors; this module holds what is
the same for every such strategy:

* :func:`is_shard`, :func:`local`, :func:`holds_shards`, :func:`shard_like`: a DTensor,
  this rank's part of it, whether a state entry holds one, a tensor laid out as one;
  :func:`shards_apart`: DTensors and plain tensors in separate lists (for foreach calls);
* :func:`save_shards` / :func:`read_shards` (``torch.distributed.checkpoint``): each rank
  writes its own part of the sharded entries; read back, at any world size, through
  :class:`SafeShardReader`, which runs nothing stored in the files;
* :func:`local_bytes`: what this rank holds of parameters, gradients and optimizer state.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

from ..errors import DdpxError


def is_shard(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (each rank holds a part of it)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def shards_apart(tensors) -> list[list]:
    """``tensors`` as [DTensors, plain tensors], empty groups left out: a ``torch._foreach_*`` call
    (clipping's, the optimizers') refuses a list that mixes them."""
    tensors = list(tensors)
    groups = [[t for t in tensors if is_shard(t)], [t for t in tensors if not is_shard(t)]]
    return [g for g in groups if g]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (the tensor itself when it is not a DTensor)."""
    return tensor.to_local() if is_shard(tensor) else tensor


def holds_shards(value) -> bool:
    """Whether ``value`` (a state entry: nested dicts and lists) holds a DTensor."""
    if isinstance(value, dict):
        return any(holds_shards(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_shards(v) for v in value)
    return is_shard(value)


def shard_like(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``part`` (a plain tensor shaped as this rank's part of ``like``) as a DTensor laid out as
    ``like``, sharing ``part``'s memory (a load into it fills ``part``); ``part`` itself when
    ``like`` is not a DTensor."""
    if not is_shard(like):
        return part
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(part, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def local_bytes(module: nn.Module, optimizer=None) -> dict:
    """Bytes this rank holds of parameters, gradients and optimizer state (its parts of DTensors)."""
    def size(t):
        t = local(t)
        return t.numel() * t.element_size()

    params = sum(size(p) for p in module.parameters())
    grads = sum(size(p.grad) for p in module.parameters() if p.grad is not None)
    state = 0
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state += sum(size(v) for v in per_param.values() if torch.is_tensor(v))
    return {"parameters": params, "gradients": grads, "optimizer": state}


# What a shard directory's ``.metadata`` (a pickle) may name: DCP's own plain records, torch's
# sizes, dtypes and layouts, and the path it was written to. Nothing else is looked up, so
# loading it cannot call anything else.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout")} | {
    (module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "WindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}, which a ddpx shard directory never holds")


def _reader_classes():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeShardReader(FileSystemReader):
        """DCP's reader, with the metadata unpickled through an allow-list (tensors are read
        with ``weights_only=True`` by DCP itself)."""

        def read_metadata(self, *args, **kwargs):
            if hasattr(self, "_get_metadata_path"):  # newer torch (it may name a per-rank file); 2.7 has none
                path = self._get_metadata_path(kwargs.get("rank"))
            else:
                path = self.fs.concat_path(self.path, ".metadata")
            with self.fs.create_stream(path, "rb") as stream:
                try:
                    metadata = _MetadataUnpickler(stream).load()
                except pickle.UnpicklingError as exc:
                    raise DdpxError(f"refusing shard directory {self.path}: its metadata needs {exc} (loading it "
                                    "could run code); nothing in it was run") from None
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """Non-tensor entries (the optimizer's hyperparameters) read as plain data only."""

        def load_bytes(self, read_item, value):
            from torch.distributed.checkpoint._traverse import set_element

            plain = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], plain)
            else:
                self.state_dict[read_item.dest_index.fqn] = plain

    return SafeShardReader, SafeLoadPlanner


def save_shards(state: dict, directory: Path) -> None:
    """Every rank writes its shards of ``state`` into ``directory`` (collective); rank 0 writes
    the metadata last, after every rank's files are complete."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True))


def read_shards(template: dict, directory: Path) -> dict:
    """Fill ``template`` (this rank's sharded entries, laid out as this run holds them, at any world size)
    from ``directory`` in place and return it, less the entries the directory does not hold (a
    checkpoint written without EMA). Collective."""
    import torch.distributed.checkpoint as dcp

    reader_class, planner = _reader_classes()
    reader = reader_class(str(directory))
    stored = {key.split(".", 1)[0] for key in reader.read_metadata().state_dict_metadata}
    template = {k: v for k, v in template.items() if k in stored}
    dcp.load(template, storage_reader=reader, planner=planner())
    return template


