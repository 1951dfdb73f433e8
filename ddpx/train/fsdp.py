"""``trainer.strategy: fsdp``: the model sharded with torch's FSDP2 (``fully_shard``).

Each rank holds 1/world of every parameter, gradient and optimizer state (DTensors
sharded on dim 0); a unit's parameters are all-gathered before its forward and
backward, and its gradients reduce-scattered after its backward. The step stays
:meth:`ddpx.train.trainer.Trainer.train_step`; this module holds what differs
from DDP:

* :func:`wrap`: which modules become FSDP units (``fsdp.units``, :func:`unit_modules`),
  ``fsdp.reshard_after_forward``, the mixed-precision policy (:func:`mixed_precision`), the
  mesh (:func:`device_mesh`: HSDP with ``fsdp.shard_size``) and ``fsdp.offload`` (:func:`offload_policy`);
* :func:`unsynced`: accumulation without communication (``set_requires_gradient_sync``);
* :func:`padded_forwards`, :func:`reshard`: evaluation, where every forward is collective;
* the state: :func:`sharded_state` / :func:`load_sharded_state` (model and optimizer
  keyed by parameter name, so any world size can read them), :func:`save_shards` /
  :func:`read_shards` (``torch.distributed.checkpoint``: each rank writes its own
  shards; read back through :class:`SafeShardReader`, which runs nothing stored in
  the files), :func:`full_model_state_dict` (one consolidated copy, for export).
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..data.stream import has_length
from ..errors import DdpxError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fsdp.units: auto looks one level into these containers (a transformer's list of blocks)
UNIT_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def enabled(config) -> bool:
    """Whether the run shards its model (``trainer.strategy: fsdp``)."""
    return config.trainer.get("strategy", "ddp") == "fsdp"


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` was wrapped by :func:`wrap` (its parameters are DTensors)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def unit_modules(model: nn.Module, units, min_params: int) -> list[tuple[str, nn.Module]]:
    """The submodules that become FSDP units, as ``(name, module)``, parents before children.

    ``auto``: the model's direct children, and the items of a child that is a
    ModuleList / ModuleDict / Sequential (a transformer's blocks), that hold at least
    ``min_params`` parameters. A list of class names: every submodule of one of those
    classes (a name no submodule has is an error). The model itself is always the
    root unit, which holds every parameter no unit took."""
    if units == "auto":
        candidates = []
        for name, child in model.named_children():
            if isinstance(child, UNIT_CONTAINERS):
                candidates += [(f"{name}.{n}", c) for n, c in child.named_children()]
            else:
                candidates.append((name, child))
        return [(name, m) for name, m in candidates if param_count(m) >= min_params]
    found = [(name, m) for name, m in model.named_modules() if name and type(m).__name__ in units]
    missing = [u for u in units if u not in {type(m).__name__ for _, m in found}]
    if missing:
        classes = sorted({type(m).__name__ for name, m in model.named_modules() if name})
        raise DdpxError(f"fsdp.units names {', '.join(missing)}, but no submodule of {type(model).__name__} is of "
                        f"that class (its classes: {', '.join(classes[:12])}{', ...' if len(classes) > 12 else ''}); "
                        "list class names of your model's blocks, or set fsdp.units=auto")
    return found


def mixed_precision(config):
    """FSDP2's ``MixedPrecisionPolicy``: with ``amp.enabled`` and ``fsdp.param_dtype: amp`` the
    parameters are gathered and computed in ``amp.dtype`` (half the all-gather bytes); with
    ``fsdp.param_dtype: fp32`` they stay fp32 and autocast casts per op, ddp's numerics
    (norm layers in fp32). Gradients are reduced in ``fsdp.reduce_dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    amp = config.get("amp") or {}
    in_amp = amp.get("enabled") and config.fsdp.get("param_dtype", "amp") == "amp"
    param_dtype = DTYPES[amp["dtype"]] if in_amp else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[config.fsdp.reduce_dtype])


def shard_size(setting, world_size: int) -> int:
    """The ranks each parameter is sharded over (``fsdp.shard_size``): ``all`` the world, ``node``
    the ranks of one node (torchrun's layout, agreed over the ranks: one all_gather_object), a
    number that many consecutive ranks. The same answer, or the same error, on every rank."""
    if setting == "all":
        return world_size
    if setting == "node":
        from ..comm_hooks.scope import node_facts

        facts = [None] * world_size
        dist.all_gather_object(facts, node_facts())
        sizes = {f[2] for f in facts if f is not None}
        if None in facts or len(sizes) != 1 or None in sizes:
            raise DdpxError("fsdp.shard_size=node needs the launcher's node layout (torchrun's GROUP_RANK, LOCAL_RANK "
                            "and LOCAL_WORLD_SIZE) on every rank; give the ranks per node as a number, "
                            "e.g. fsdp.shard_size=8")
        per_node = sizes.pop()
        if any(rank != node * per_node + local for rank, (node, local, _) in enumerate(facts)):
            raise DdpxError("fsdp.shard_size=node needs each node's ranks to be consecutive (as torchrun numbers "
                            "them); give the shard size as a number of consecutive ranks, e.g. fsdp.shard_size=8")
        return per_node
    if world_size % setting:
        raise DdpxError(f"fsdp.shard_size={setting} does not divide the {world_size} ranks into shard groups; use a "
                        f"divisor of {world_size} (the ranks of one node, fsdp.shard_size=node), or all")
    return setting


def device_mesh(trainer):
    """A 1-D mesh over every rank (FSDP), or with ``fsdp.shard_size`` below the world size a 2-D
    one, ``(replicate, shard)``: each parameter sharded over ``shard`` consecutive ranks (a node)
    and replicated over the ``replicate`` groups (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = trainer.world_size
    shard = shard_size(trainer.config.fsdp.shard_size, world)
    if shard == world:
        return init_device_mesh(trainer.device.type, (world,))
    return init_device_mesh(trainer.device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))


def shard_group(tensor: torch.Tensor):
    """The process group ``tensor`` (a DTensor) is sharded over: the whole world under FSDP, one
    shard group (a node) under HSDP, whose replicas hold the same shards."""
    mesh = tensor.device_mesh
    dims = [i for i, placement in enumerate(tensor.placements) if placement.is_shard()]
    return mesh.get_group(dims[0]) if mesh.ndim > 1 else mesh.get_group()


def offload_policy(setting: str, device: torch.device):
    """FSDP2's offload policy for ``fsdp.offload``: ``cpu`` keeps the shards, their gradients and
    the optimizer state in pinned CPU memory (the optimizer steps there); CUDA only."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if setting == "none":
        return OffloadPolicy()
    if device.type != "cuda":
        raise DdpxError(f"fsdp.offload=cpu moves the shards from GPU memory to CPU memory, but this run computes on "
                        f"the {device.type} (trainer.device), where they already are; set fsdp.offload=none")
    return CPUOffloadPolicy(pin_memory=True)


def wrap(trainer, model: nn.Module) -> nn.Module:
    """``fully_shard`` each unit (bottom-up), then the model as the root unit, over
    :func:`device_mesh`; returns the model (FSDP2 wraps in place). The root keeps its
    parameters gathered from forward to backward (it is needed first in backward); the units
    follow ``fsdp.reshard_after_forward``."""
    from torch.distributed.fsdp import fully_shard

    cfg = trainer.config.fsdp
    offload = offload_policy(cfg.offload, trainer.device)
    mesh = device_mesh(trainer)
    policy = mixed_precision(trainer.config)
    units = unit_modules(model, cfg.units if cfg.units == "auto" else list(cfg.units), cfg.min_unit_params)
    for _, unit in reversed(units):  # children before their parents
        fully_shard(unit, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy,
                    offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload)
    layout = f"{trainer.world_size} ranks" if mesh.ndim == 1 else \
        f"{mesh.size(1)} ranks, replicated {mesh.size(0)} times (HSDP)"
    if units:
        names = f"{', '.join(name for name, _ in units[:4])}{', ...' if len(units) > 4 else ''}"
        trainer.log.info(f"fsdp: {len(units)} units ({names}) + the root sharded over {layout}")
    else:  # one unit: the whole model is gathered at once in forward and backward
        trainer.log.info(f"fsdp: the whole model is one unit (the root), sharded over {layout}; no submodule was "
                         f"made a unit (fsdp.units={cfg.units}, fsdp.min_unit_params={cfg.min_unit_params}), so "
                         "every parameter is gathered at once")
    return model


@contextlib.contextmanager
def unsynced(module: nn.Module):
    """Backward passes without the gradients' reduce-scatter (accumulation): the unsharded
    gradients add up until a backward outside this context reduces them."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def is_shard(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def holds_shards(value) -> bool:
    """Whether ``value`` (a state entry: nested dicts and lists) holds a DTensor."""
    if isinstance(value, dict):
        return any(holds_shards(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_shards(v) for v in value)
    return is_shard(value)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (the tensor itself when it is not a DTensor)."""
    return tensor.to_local() if is_shard(tensor) else tensor


def reshard(module: nn.Module) -> None:
    """Free the gathered parameters of every unit (the root keeps its own after a forward
    without backward, e.g. in evaluation), so the module holds its shards again."""
    for m in module.modules():
        if is_sharded(m):
            m.reshard()


def padded_forwards(trainer, loader) -> int:
    """How many forwards this rank runs beyond its evaluation batches so that every rank runs
    as many (each forward all-gathers: a rank with fewer would hang the others); the extra
    ones repeat its last batch. One all_reduce."""
    if not has_length(loader):
        raise DdpxError("under trainer.strategy=fsdp the evaluation set needs a length (every rank must run the "
                        "model as often as the others); give the eval set __len__, or use trainer.strategy=ddp")
    batches = len(loader)
    counts = torch.tensor([batches, -batches], dtype=torch.int64, device=trainer.device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # the most batches, minus the fewest
    most, fewest = int(counts[0]), -int(counts[1])
    if fewest == 0 and most > 0:  # every rank raises: none is left waiting in a forward
        raise DdpxError("a rank has no evaluation batch under trainer.strategy=fsdp, where every rank must run the "
                        "model as often as the others; use a larger evaluation set or fewer ranks")
    extra = most - batches
    return extra


# --- state ----------------------------------------------------------------------------


def sharded_state(module: nn.Module, optimizer) -> tuple[dict, dict]:
    """The model's and the optimizer's state, keyed by parameter name, each rank with its shards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(module, optimizer)


def load_sharded_state(module: nn.Module, optimizer, model_state: Optional[dict], optimizer_state: Optional[dict]):
    """Put back what :func:`sharded_state` returned (also as read at another world size); a part
    that is None is left as it is."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if model_state is not None:
        set_model_state_dict(module, model_state)
    if optimizer_state is not None:
        set_optimizer_state_dict(module, optimizer, optimizer_state)


def full_model_state_dict(module: nn.Module) -> dict:
    """The whole model's weights as plain CPU tensors on rank 0 (empty elsewhere): every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


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
    """Fill ``template`` (this rank's sharded entries, e.g. :func:`sharded_state`, at any world size)
    from ``directory`` in place and return it, less the entries the directory does not hold (a
    checkpoint written without EMA). Collective."""
    import torch.distributed.checkpoint as dcp

    reader_class, planner = _reader_classes()
    reader = reader_class(str(directory))
    stored = {key.split(".", 1)[0] for key in reader.read_metadata().state_dict_metadata}
    template = {k: v for k, v in template.items() if k in stored}
    dcp.load(template, storage_reader=reader, planner=planner())
    return template


def local_bytes(module: nn.Module, optimizer=None) -> dict:
    """Bytes this rank holds of parameters, gradients and optimizer state (its shards under fsdp)."""
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
