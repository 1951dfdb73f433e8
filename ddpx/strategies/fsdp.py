"""``trainer.strategy: fsdp``: the model sharded with torch's FSDP2 (``fully_shard``).

Each rank holds 1/world of every parameter, gradient and optimizer state (DTensors
sharded on dim 0); a unit's parameters are all-gathered before its forward and
backward, and its gradients reduce-scattered after its backward. The step stays the
trainer's; :class:`FSDPStrategy` answers what differs from ddp:

* the wrap: which modules become FSDP units (``fsdp.units``, :func:`unit_modules`),
  ``fsdp.reshard_after_forward``, the mixed-precision policy (:func:`mixed_precision`), the
  mesh (:func:`device_mesh`: HSDP with ``fsdp.shard_size``) and ``fsdp.offload``
  (:func:`offload_policy`); compression as FSDP2's gradient reduce-scatter
  (ddpx/comm_hooks/reduce_scatter.py);
* accumulation without communication (``set_requires_gradient_sync``);
* evaluation, where every forward is collective (:func:`padded_forwards`, then reshard);
* the state: the model and optimizer keyed by parameter name, each rank its shards (any
  world size can read them), written by every rank (ddpx/strategies/shards.py); the
  gradient norm summed over the ranks a gradient is sharded over.

The config section ``fsdp`` is one of ddpx's own (ddpx/config/schema.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..data.stream import has_length
from ..errors import DdpxError
from ..rank.model_files import names_by_tensor
from . import shards
from .base import PartReduction, Strategy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fsdp.units: auto looks one level into these containers (a transformer's list of blocks)
UNIT_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# ``scripts/compat.sh`` with torch 2.7.1: FSDP2 over gloo summed the gradients over the ranks
# instead of averaging them (2x the ddp gradient on 2 ranks). Tested: torch 2.13.
MIN_TORCH = (2, 8)


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class Units(list):
    """The submodules that become FSDP units, as ``(name, module)``, parents before children; what
    ``auto`` found besides: ``blocks`` (the model's repeated blocks, ``(name, module)``) and
    ``tied`` (candidates kept in the root because they share a parameter with a module outside
    them, ``(name, shared parameter names)``), for the start-up line."""

    def __init__(self, units=(), blocks=(), tied=()):
        super().__init__(units)
        self.blocks, self.tied = list(blocks), list(tied)


def unit_modules(model: nn.Module, units, min_params: int) -> Units:
    """The submodules that become FSDP units. The model itself is always the root unit, which
    holds every parameter no unit took.

    ``auto``: the model's blocks (:func:`block_modules`), and every other piece beside them
    (the children of the model, of a ModuleList / ModuleDict / Sequential and of a module
    that holds blocks) that holds at least ``min_params`` parameters. A piece whose parameters
    a module outside it uses too (tied embeddings: ``wte`` and ``lm_head``) stays in the root:
    FSDP shards a parameter in one unit only. A list of class names: every submodule of one of
    those classes (a name no submodule has, or a unit that shares a parameter with a module
    outside it, is an error)."""
    shared = shared_parameters(model)
    if units == "auto":
        blocks = block_modules(model)
        pieces = _pieces(model, blocks)
        large = [(name, m) for name, m in pieces if param_count(m) >= min_params]
        tied = [(name, shared(name)) for name, _ in large if shared(name)]
        return Units([(name, m) for name, m in large if not shared(name)], blocks, tied)
    found = [(name, m) for name, m in model.named_modules() if name and type(m).__name__ in units]
    missing = [u for u in units if u not in {type(m).__name__ for _, m in found}]
    if missing:
        classes = sorted({type(m).__name__ for name, m in model.named_modules() if name})
        raise DdpxError(f"fsdp.units names {', '.join(missing)}, but no submodule of {type(model).__name__} is of "
                        f"that class (its classes: {', '.join(classes[:12])}{', ...' if len(classes) > 12 else ''}); "
                        "list class names of your model's blocks, or set fsdp.units=auto")
    for name, module in found:
        if shared(name):
            raise DdpxError(f"fsdp.units names {type(module).__name__}, but {name} shares a parameter with "
                            f"{', '.join(shared(name))} outside it (tied weights), and FSDP shards a parameter in "
                            f"one unit only; leave {type(module).__name__} out of fsdp.units (the root then holds "
                            "it), or set fsdp.units=auto")
    return Units(found)


def shared_parameters(model: nn.Module):
    """A function of a submodule's name: the names, outside that submodule, of the parameters it
    shares with other modules of ``model`` (tied weights, a module used in two places); [] if none."""
    groups = names_by_tensor(model.named_parameters(remove_duplicate=False))

    def shared(prefix: str) -> list:
        def inside(n):
            return n.startswith(prefix + ".")
        return sorted(n for group in groups if any(map(inside, group)) for n in group if not inside(n))

    return shared


def block_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, outermost first and not inside one another, as ``(name,
    module)``: the submodules of the classes a HuggingFace model names in ``_no_split_modules``
    (where the model has any), else the items of a ModuleList / ModuleDict / Sequential that
    repeat one class with parameters (a transformer's layers, at any depth)."""
    hint = {c for m in model.modules() for c in (getattr(m, "_no_split_modules", None) or ())}

    def repeated(parent, child):
        return isinstance(parent, UNIT_CONTAINERS) and param_count(child) > 0 and \
            sum(type(c) is type(child) for c in parent.children()) > 1

    def walk(module, prefix, by_hint):
        for name, child in module.named_children():
            if (type(child).__name__ in hint) if by_hint else repeated(module, child):
                yield prefix + name, child
            else:
                yield from walk(child, f"{prefix}{name}.", by_hint)

    hinted = list(walk(model, "", True)) if hint else []
    return hinted or list(walk(model, "", False))


def _pieces(model: nn.Module, blocks: list) -> list[tuple[str, nn.Module]]:
    """The unit candidates of ``auto``: the ``blocks``, and the children of the model, of a
    container and of a module that holds blocks."""
    block_ids = {id(m) for _, m in blocks}
    holders = {".".join(name.split(".")[:i]) for name, _ in blocks for i in range(1, name.count(".") + 1)}

    def walk(module, prefix):
        for name, child in module.named_children():
            path = prefix + name
            if id(child) not in block_ids and (isinstance(child, UNIT_CONTAINERS) or path in holders):
                yield from walk(child, path + ".")
            else:
                yield path, child

    return list(walk(model, ""))


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


def shard_model(trainer, model: nn.Module):
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
    trainer.log.info(units_line(units, layout, cfg.min_unit_params))
    return model


def units_line(units: Units, layout: str, min_params: int) -> str:
    """The start-up line: the units, the tied pieces kept in the root, or, with no unit, why and
    the ``fsdp.units`` that would shard the blocks one at a time."""
    tied = "; tied, kept in the root: " + ", ".join(f"{name} (shares {', '.join(outside)})"
                                                    for name, outside in units.tied) if units.tied else ""
    if units:
        names = f"{', '.join(name for name, _ in units[:4])}{', ...' if len(units) > 4 else ''}"
        return f"fsdp: {len(units)} units ({names}) + the root sharded over {layout}{tied}"
    line = f"fsdp: the whole model is one unit (the root), sharded over {layout}, so every parameter is gathered " \
           f"at once{tied}; "
    kinds = ", ".join(sorted({type(m).__name__ for _, m in units.blocks}))
    if not kinds:
        return line + "fsdp.units=auto found no repeated block; name your model's block class, e.g. fsdp.units=[Block]"
    biggest = max(param_count(m) for _, m in units.blocks)
    if biggest >= min_params:
        return line + f"its blocks ({kinds}) share parameters with modules outside them, so none is a unit of its own"
    return line + (f"its {len(units.blocks)} blocks ({kinds}) hold up to {biggest} parameters each, below "
                   f"fsdp.min_unit_params={min_params}; to gather one at a time: fsdp.units=[{kinds}]")


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


def reshard(module: nn.Module) -> None:
    """Free the gathered parameters of every unit (the root keeps its own after a forward
    without backward, e.g. in evaluation), so the module holds its shards again."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class FSDPStrategy(Strategy):
    """Each rank holds its shards of the model, its gradients and the optimizer state."""

    replicated = False
    compression_advice = "compress the gradients' reduce-scatter with comm_hook.name=int8 (or bf16, fp16)"

    @classmethod
    def check_config(cls, values):
        from torch.torch_version import TorchVersion

        if TorchVersion(torch.__version__) < MIN_TORCH:
            raise DdpxError(f"trainer.strategy=fsdp needs torch >= 2.8 (torch {torch.__version__}'s FSDP2 sums the "
                            "gradients over the ranks instead of averaging them); upgrade torch, or set "
                            "trainer.strategy=ddp")

    @classmethod
    def check_compression(cls, config, method, options):
        """The methods with a sharded form (``Method.sharded``: ddpx/comm_hooks/reduce_scatter.py)
        apply, on fp32 gradients; any other is refused, as are options they do not take."""
        from ..comm_hooks import methods

        name = method.name
        if method.sharded is None:
            *first, last = sorted(m.name for m in methods() if m.sharded is not None)
            raise DdpxError(f"comm_hook.name={name} does not apply under trainer.strategy=fsdp "
                            f"(only {', '.join(first)} and {last} have a sharded reduce-scatter); set "
                            f"comm_hook.name=int8 (or {', '.join(first)}, allreduce)")
        reduce_dtype = config.fsdp.reduce_dtype
        if reduce_dtype != "fp32":
            raise DdpxError(f"comm_hook.name={name} under trainer.strategy=fsdp codes and sums "
                            f"fp32 gradients itself; set fsdp.reduce_dtype=fp32 (now {reduce_dtype}), or "
                            f"comm_hook.name=allreduce to reduce-scatter in {reduce_dtype}")
        method.make_sharded(**options)  # bad options fail here
        shard_size = config.fsdp.get("shard_size", "all")
        if shard_size != "all" and options.get("scope", "global") != "global":
            raise DdpxError(f"comm_hook.options.scope={options['scope']} does not apply under "
                            f"fsdp.shard_size={shard_size} (HSDP): the reduce-scatter runs inside each shard group "
                            "and the replicas' all-reduce is FSDP's own; remove the scope option, or set "
                            "fsdp.shard_size=all")

    def wrap(self, trainer, module):
        return shard_model(trainer, module)

    def install_compression(self, trainer, model):
        from ..comm_hooks import reduce_scatter

        if self.compression is None:
            return None
        method, options, _ = self.compression  # native does not apply: Python around the native kernels
        name = method.name
        comm = method.make_sharded(**options)
        units = reduce_scatter.install(model, comm)
        opts = "".join(f", {k} {v}" for k, v in comm.opts.items())
        shard_size = trainer.config.fsdp.get("shard_size", "all")
        hsdp = "" if shard_size == "all" else (f"; fsdp.shard_size={shard_size}: it runs inside each shard group, and "
                                                "the replicas' all-reduce stays FSDP's own, in fsdp.reduce_dtype")
        trainer.log.info("comm hook %s installed on %d fsdp units (reduce-scatter: %s codes, one all_to_all, fp32 "
                         "sum%s%s)", name, units, name, opts, hsdp)
        return comm

    def no_sync(self, model):
        """Backward passes without the gradients' reduce-scatter: the unsharded gradients add up
        until a backward outside this context reduces them."""
        @contextlib.contextmanager
        def unsynced():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return unsynced

    def part_reduction(self, module):
        """Each rank holds a part of every sharded gradient: the parts' squares are summed over
        the ranks they are sharded over (under HSDP the shard group, whose replicas hold the
        same shards), on the mesh's device (``fsdp.offload=cpu`` keeps the gradients on the CPU)."""
        first = next((p for p in module.parameters() if shards.is_shard(p)), None)
        if first is None:
            return None
        group = shard_group(first)

        def reduce(tensor, op):
            dist.all_reduce(tensor, op=op, group=group)

        return PartReduction(holds_part=shards.is_shard, reduce=reduce,
                             device=torch.device(first.device_mesh.device_type))

    @contextlib.contextmanager
    def evaluating(self, trainer, loader):
        yield padded_forwards(trainer, loader)
        reshard(trainer.module)

    def model_state(self, module, optimizer):
        """Each rank's shards, keyed by parameter name (any world size can read them back)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(module, optimizer)

    def load_model_state(self, module, optimizer, model_state, optimizer_state):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if model_state is not None:
            set_model_state_dict(module, model_state)
        if optimizer_state is not None:
            set_optimizer_state_dict(module, optimizer, optimizer_state)

    def sharded_entries(self, state):
        """The model, the optimizer and any plugin entry with DTensors in it (the ema plugin's average)."""
        return tuple(k for k, v in state.items() if k in ("model", "optimizer") or shards.holds_shards(v))

    def full_state_dict(self, module):
        """The whole model gathered (every rank takes part), as plain CPU tensors on rank 0. On the
        CPU the gather may hand back the module's own tensors (the buffers; the parameters at 1
        rank): those are copied."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        own = {shards.local(t).untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
        return {k: v.clone() if v.untyped_storage().data_ptr() in own else v for k, v in state.items()}
