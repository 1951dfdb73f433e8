"""``trainer.strategy: tensor``: each Linear layer of a pair split over ``tensor.size`` consecutive ranks
(Megatron-style tensor parallelism on ``torch.distributed.tensor.parallel``).

The plan (ddpx/strategies/tensor_plan.py, :func:`~ddpx.strategies.tensor_plan.resolve_plan`): which of the model's ``nn.Linear`` modules are split, and how.
``colwise`` splits a layer's outputs (its weight's rows: a rank computes ``out / size`` features,
an attention projection ``n_heads / size`` heads), ``rowwise`` its inputs (a rank takes its slice of
the features and the partial outputs are summed over the ranks: one all_reduce), ``qkv`` is a
colwise split of a fused ``[q; k; v]`` projection in which each rank holds the rows
``[q_r; k_r; v_r]`` of its heads (:class:`FusedQKV`). A colwise layer followed by a rowwise one
(attention's projections, an MLP's up and down) communicates once forward and once backward.
HuggingFace's ``Conv1D`` (GPT-2's layers, weights ``[in, out]``) takes the same styles on its
weight's output dimension (``output_dim``: 1, where a Linear's is 0).
``tensor.plan: auto`` uses ``AUTO_PLAN`` (the usual transformer names); a dict
``{pattern: colwise|rowwise|qkv|none}`` adds to it and overrides it. Everything else (embeddings,
norms, an output head) stays whole on every rank.

A module that owns split attention projections computes fewer heads: its head counts
(``HEAD_ATTRS``) and head widths (``WIDTH_ATTRS``) are divided by the size, so a model
whose attention reshapes with those attributes, or with ``-1``, runs unchanged.

The mesh is ``(dp, tp)`` (ddpx/strategies/mesh.py): a tensor group's ranks are consecutive (inside a
node, where the per-layer all_reduces stay); with more ranks than ``tensor.size`` the replicas'
gradients are averaged over the ``dp`` group by one all_reduce per step (:meth:`TensorStrategy.
forward_backward`: DDP cannot hold DTensor parameters). Every rank of a replica loads the same
batches and draws from the same random stream, so dropout on the replicated activations agrees.

State: the split parameters are DTensors; checkpoints hold each rank's parts through
``torch.distributed.checkpoint``, keyed by the user's names, so another ``tensor.size`` (or world
size) can resume them. A fused qkv parameter is stored as its three parts ``{q, k, v}``, each a
DTensor of the user's layout (:func:`split_fused`), and ``run_dir/model/`` holds the whole model in
the user's layout (:meth:`TensorStrategy.full_state_dict`).
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DdpxError
from ..fused_allreduce import fused_allreduce
from . import shards
from .base import PartReduction, Strategy
from .mesh import model_parallel_mesh
from .tensor_plan import name_list, check_plan, check_split, output_dim, resolve_plan

def permute_fused(full: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
    """``[q; k; v]`` along ``dim`` (a Linear's rows, a Conv1D's columns) as ``[q_0; k_0; v_0; q_1; ...]``:
    rank r's contiguous slice is its heads'."""
    moved = full.movedim(dim, 0)
    rows = moved.shape[0] // 3
    return moved.reshape(3, size, rows // size, *moved.shape[1:]).transpose(0, 1).reshape(moved.shape).movedim(0, dim)


def unpermute_fused(permuted: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
    """The inverse of :func:`permute_fused`: the user's ``[q; k; v]`` layout."""
    moved = permuted.movedim(dim, 0)
    rows = moved.shape[0] // 3
    return moved.reshape(size, 3, rows // size, *moved.shape[1:]).transpose(0, 1).reshape(moved.shape).movedim(0, dim)


def shard_dim(tensor) -> int:
    """The dimension a split DTensor is sharded on (a fused parameter's: its output features)."""
    return next(p.dim for p in tensor.placements if p.is_shard())


def parallel_styles(split: dict) -> dict:
    """``{name: style}`` as torch's ColwiseParallel / RowwiseParallel, for ``nn.Linear`` and Conv1D alike:
    a parameter is split on its weight's output dimension (:func:`output_dim`; a bias on its only one),
    or for rowwise on the weight's input dimension with the bias whole. A ``qkv`` layer is colwise with
    its fused outputs permuted first (:func:`permute_fused`), so each rank's shard is ``[q_r; k_r; v_r]``
    and ``chunk(3)`` (or a split by the divided width) of its output gives its heads' q, k, v."""
    from functools import partial

    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def place(style, module, mesh, placements):
        """Each parameter of ``module`` distributed as ``placements(parameter)`` says."""
        for pname, param in list(module.named_parameters()):
            placement, value = placements(param)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(value, mesh, [placement], src_data_rank=style.src_data_rank),
                requires_grad=param.requires_grad))

    def apply(style, module, mesh):
        return distribute_module(module, mesh, style._partition_linear_fn,
                                 partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
                                 partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))

    class Colwise(ColwiseParallel):
        fused = False

        def _partition_linear_fn(self, name, module, mesh):
            out = output_dim(module)

            def placements(param):
                dim = out if param.dim() == 2 else 0
                value = permute_fused(param.detach(), mesh.size(), dim) if self.fused else param
                return Shard(dim), value

            place(self, module, mesh, placements)

        def _apply(self, module, mesh):
            return apply(self, module, mesh)

    class FusedQKV(Colwise):
        fused = True

    class Rowwise(RowwiseParallel):
        def _partition_linear_fn(self, name, module, mesh):
            inputs = 1 - output_dim(module)
            place(self, module, mesh, lambda param: (Shard(inputs) if param.dim() == 2 else Replicate(), param))

        def _apply(self, module, mesh):
            self.desired_input_layouts = (Shard(-1),)
            return apply(self, module, mesh)

    kinds = {"colwise": Colwise, "rowwise": Rowwise, "qkv": FusedQKV}
    return {name: kinds[style]() for name, style in split.items()}


def split_fused(tensor, like=None):
    """A fused parameter's DTensor (or this rank's part of one, laid out as ``like``) as ``{q, k, v}``:
    three DTensors of the user's layout, each sharded as ``like`` (on its output features), views of
    the rank's slice."""
    from torch.distributed.tensor import DTensor

    like = tensor if like is None else like
    dim = shard_dim(like)
    local = shards.local(tensor)
    shape = list(like.shape)
    shape[dim] //= 3
    stride = torch.empty(shape, device="meta").stride()
    return {key: DTensor.from_local(part, like.device_mesh, like.placements, run_check=False, shape=torch.Size(shape),
                                    stride=stride)
            for key, part in zip("qkv", local.chunk(3, dim=dim))}


def is_fused_entry(value) -> bool:
    return isinstance(value, dict) and sorted(value) == ["k", "q", "v"]


def join_fused(parts: dict, like) -> torch.Tensor:
    """:func:`split_fused`'s inverse: the rank's slice ``[q_r; k_r; v_r]`` as a DTensor laid out as ``like``."""
    from torch.distributed.tensor import DTensor

    local = torch.cat([shards.local(parts[key]) for key in "qkv"], dim=shard_dim(like))
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def is_split(tensor) -> bool:
    """Whether ``tensor`` is a DTensor sharded over the tensor group (a split layer's weight, a
    colwise bias), not a replicated one (a rowwise layer's bias)."""
    return shards.is_shard(tensor) and any(p.is_shard() for p in tensor.placements)


def share_random_state(group, src: int, device: torch.device) -> None:
    """Python's, numpy's and torch's (CPU and ``device``'s) random states of global rank ``src``
    on every rank of ``group``."""
    import random
    import sys

    numpy = sys.modules.get("numpy")
    state = [(random.getstate(), numpy.random.get_state() if numpy else None, torch.get_rng_state(),
              torch.cuda.get_rng_state(device) if device.type == "cuda" else None)]
    dist.broadcast_object_list(state, src=src, group=group)
    python, np_state, cpu, cuda = state[0]
    random.setstate(python)
    if numpy is not None and np_state is not None:
        numpy.random.set_state(np_state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _collapse(read, original):
    """``original`` (a template entry) where ``read`` holds it expanded into {q, k, v} parts."""
    if isinstance(original, dict) and isinstance(read, dict):
        return {k: _collapse(read[k], v) if k in read else v for k, v in original.items()}
    return original if torch.is_tensor(original) and is_fused_entry(read) else read


class ReplicaCompression:
    """``comm_hook.name`` on a tensor strategy's replica average, as the comm_hook plugin and the
    loggers see one hook state: one state codes the split layers' parts, another the whole layers'
    gradients, in calls of their own: a whole layer's gradient is the same on every rank of a
    tensor group and must be coded alike on each, whatever the rank's own parts beside it in a
    bucket are. (ddpx's methods code each tensor on its own, so a mixed bucket kept them equal too
    when tried with int8, onebit, powersgd and bf16 on 2 x 2 ranks; apart, a method need not.)
    Each state gets the same tensors every step (its memory is keyed by them)."""

    def __init__(self, name, options, group, parts, whole):
        from ..comm_hooks import make

        self.lists = [(make(name, group, **options)[0], [torch.zeros_like(t) for t in tensors])
                      for tensors in (parts, whole) if tensors]
        self.name, self.opts = name, self.lists[0][0].opts
        self.group = group

    def reduce(self, parts, whole) -> None:
        for (state, buffers), grads in zip(self.lists, [g for g in (parts, whole) if g]):
            torch._foreach_copy_(buffers, grads)
            fused_allreduce(buffers, op="avg", compression=state, process_group=self.group, async_op=False)
            torch._foreach_copy_(grads, buffers)

    def pair(self, optimizer) -> None:
        for state, _ in self.lists:
            state.pair(optimizer)

    def stats(self) -> dict:
        each = [state.stats() for state, _ in self.lists]
        total = {key: sum(s[key] or 0 for s in each) for key in ("raw_bytes", "wire_bytes", "fp32_wire_bytes",
                                                                  "buckets")}
        total.update(name=self.name, steps=max(s["steps"] for s in each),
                     compression=total["raw_bytes"] / total["wire_bytes"] if total["wire_bytes"] else None)
        return total

    def state_dict(self) -> dict:
        return {"states": [state.state_dict() for state, _ in self.lists]}

    def load_state_dict(self, saved) -> None:
        states = saved.get("states", []) if isinstance(saved, dict) else []
        if len(states) != len(self.lists):
            raise DdpxError("the checkpoint's comm hook state is not a tensor strategy's of this model; set "
                            "checkpoint.resume=false or the comm_hook.name it was written with")
        for (state, _), sd in zip(self.lists, states):
            state.load_state_dict(sd)


class TensorStrategy(Strategy):
    """The model's Linear pairs split over ``tensor.size`` ranks; replicas of that group average
    their gradients."""

    replicated = False
    compression_advice = ("compress the replicas' gradient average with comm_hook.name=int8 (or bf16, fp16, onebit, "
                          "powersgd)")

    @classmethod
    def check_config(cls, values: Mapping) -> None:
        tensor = values.get("tensor", {})
        check_plan(tensor.get("plan", "auto"))
        trainer = values.get("trainer", {})
        if trainer.get("compile"):
            raise DdpxError("trainer.compile does not apply under trainer.strategy=tensor (its split layers run as "
                            "DTensors, which ddpx does not compile); set trainer.compile=false")
        amp = values.get("amp") or {}
        if amp.get("enabled") and amp.get("dtype") == "fp16":
            raise DdpxError("amp.dtype=fp16 does not apply under trainer.strategy=tensor (the fp16 GradScaler "
                            "cannot unscale a mix of DTensor and plain gradients); set amp.dtype=bf16")

    @classmethod
    def check_compression(cls, config, method, options):
        """A method that averages by itself (not ``onebit_adam``, whose optimizer sends the update
        through DDP) compresses the replicas' gradient average; its options are checked here."""
        if method.optimizer is not None:
            from ..comm_hooks import available

            raise DdpxError(f"comm_hook.name={method.name} does not apply under trainer.strategy=tensor (its "
                            "optimizer sends its update through DDP, which cannot hold a tensor-parallel model); set "
                            f"comm_hook.name to one of {', '.join(available())}")
        method.check_options(options)

    # --- building ------------------------------------------------------------------------

    def wrap(self, trainer, module):
        from torch.distributed.tensor.parallel import parallelize_module

        cfg = trainer.config.tensor
        size = cfg.size
        plan = cfg.plan if isinstance(cfg.plan, str) else dict(cfg.plan)
        split, unmatched = resolve_plan(module, plan)
        changes = check_split(module, split, size)
        self.key_order = list(module.state_dict())
        self.mesh = model_parallel_mesh(trainer, size, "tp", "tensor.size")
        self.tp_mesh = self.mesh["tp"]
        self.tp_group, self.dp_group = self.mesh.get_group("tp"), self.mesh.get_group("dp")
        self.tp_rank, self.dp_rank = self.mesh.get_local_rank("tp"), self.mesh.get_local_rank("dp")
        self.size, self.dp_size = size, self.mesh.size(0)
        for owner, attr, value in changes:
            setattr(owner, attr, value // size)
        parallelize_module(module, self.tp_mesh, parallel_styles(split))
        self.fused = {f"{name}.{p}" for name, style in split.items() if style == "qkv"
                      for p, _ in module.get_submodule(name).named_parameters()}
        self.fused_ids = {id(p) for name, p in module.named_parameters() if name in self.fused}
        self.params = list(module.parameters())
        self.comm_state = None
        self.syncing = True
        self.trainer = trainer
        kinds = {style: [n for n, s in split.items() if s == style] for style in ("qkv", "colwise", "rowwise")}
        listed = "; ".join(f"{style} {name_list(names, 4)}" for style, names in kinds.items() if names)
        heads = sorted({f"{type(m).__name__}.{a} {v} -> {v // size}" for m, a, v in changes})
        replicas = f"{self.dp_size} replica{'s' if self.dp_size != 1 else ''}"
        trainer.log.info(f"tensor: {len(split)} Linear layers split over {size} ranks x {replicas} "
                         f"({listed}){'; per rank: ' + ', '.join(heads) if heads else ''}; "
                         f"not split (whole on every rank): {name_list(unmatched, 8)}")
        return module

    def install_compression(self, trainer, model):
        """The replicas' average through ``comm_hook.name``'s own per-bucket code (``ddpx.fused_allreduce``
        on fused buckets of the rank's gradient parts, over the data-parallel group)."""
        if self.compression is None:
            return None
        method, options, _ = self.compression
        if self.dp_size == 1:
            trainer.log.warning("comm_hook.name=%s ignored: %d ranks make 1 replica of tensor.size=%d, so no "
                                "gradient is averaged between replicas", method.name, trainer.world_size, self.size)
            return None
        trained = [p for p in self.params if p.requires_grad]
        self.comm_state = ReplicaCompression(method.name, options, self.dp_group,
                                             [shards.local(p) for p in trained if is_split(p)],
                                             [shards.local(p) for p in trained if not is_split(p)])
        opts = "".join(f", {k} {v}" for k, v in self.comm_state.opts.items())
        trainer.log.info("comm hook %s installed on the gradient average of %d replicas (fused buckets of each rank's "
                         "parts, the whole layers' apart%s)", method.name, self.dp_size, opts)
        return self.comm_state

    def start(self, trainer):
        """The ranks of a tensor group take their first rank's random streams (a resume may have
        restored each rank's own): dropout on the replicated activations must agree."""
        if self.size > 1:
            share_random_state(self.tp_group, self.mesh["tp"].mesh[0].item(), trainer.device)

    # --- the data and the ranks ------------------------------------------------------------

    def data_parallel(self, trainer):
        return self.dp_rank, self.dp_size

    def counts_loss(self, trainer):
        return self.tp_rank == 0

    def describe_rank(self, trainer):
        if not hasattr(self, "dp_size"):  # not wrapped yet
            return ""
        return f"tensor rank {self.tp_rank} of {self.size}, replica {self.dp_rank} of {self.dp_size}"

    # --- the step ------------------------------------------------------------------------

    def forward_backward(self, trainer, batch, window):
        loss = super().forward_backward(trainer, batch, window)
        if self.syncing and self.dp_size > 1:
            self._average_replicas()
        return loss

    def _average_replicas(self) -> None:
        """Average every gradient (this rank's parts) over the replicas: fused all_reduces of them all, or the
        comm hook's compressed exchange over fused buckets."""
        for p in self.params:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        grads = [shards.local(p.grad) for p in self.params if p.requires_grad]
        if not grads:
            return
        if self.comm_state is not None:
            trained = [p for p in self.params if p.requires_grad]
            self.comm_state.reduce([g for p, g in zip(trained, grads) if is_split(p)],
                                   [g for p, g in zip(trained, grads) if not is_split(p)])
            return
        fused_allreduce(grads, op="avg", process_group=self.dp_group, async_op=False)

    def no_sync(self, model):
        """An accumulation window's backward passes but the last: the replicas' average waits."""
        @contextlib.contextmanager
        def unsynced():
            self.syncing = False
            try:
                yield
            finally:
                self.syncing = True

        return unsynced

    def replica_checks(self, module):
        """The layers left whole are the same on every rank (of the tensor group and of every replica)."""
        whole = [shards.local(p).detach().sum(dtype=torch.float64) for p in module.parameters() if not is_split(p)]
        if not whole:
            return {}
        return {"sum of the whole (not split) weights": (
            torch.stack(whole).sum(), ": the ranks drifted apart, so some rank applied another update (a tensor "
                                      "group's ranks must draw the same random numbers: dropout on the whole "
                                      "activations; a plugin may change weights on some ranks only)")}

    def part_reduction(self, module):
        """A split gradient's parts are summed over the tensor group; a whole one (replicated, the
        same on every rank of the group) is counted once."""
        group = self.tp_group

        def reduce(tensor, op):
            dist.all_reduce(tensor, op=op, group=group)

        return PartReduction(holds_part=is_split, reduce=reduce, device=self.trainer.device)

    # --- state -----------------------------------------------------------------------------

    def _split_state(self, state: dict, name: str, like) -> dict:
        """An optimizer state entry of fused parameter ``name``: its tensors shaped as the parameter as {q, k, v}."""
        return {k: split_fused(v) if shards.is_shard(v) and v.shape == like.shape else v for k, v in state.items()}

    def model_state(self, module, optimizer):
        """Each rank's parts keyed by the user's names (DTensors; the whole layers plain); a fused
        parameter and its optimizer state as {q, k, v} (another tensor.size reads them back)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(module, optimizer)
        params = dict(module.named_parameters())
        for name in self.fused:
            if name in model_state:
                model_state[name] = split_fused(model_state[name])
            if name in optimizer_state.get("state", {}):
                optimizer_state["state"][name] = self._split_state(optimizer_state["state"][name], name, params[name])
        return model_state, optimizer_state

    def load_model_state(self, module, optimizer, model_state, optimizer_state):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        params = dict(module.named_parameters())
        if model_state is not None:
            model_state = {k: join_fused(v, params[k]) if is_fused_entry(v) else v for k, v in model_state.items()}
            set_model_state_dict(module, model_state)
        if optimizer_state is not None:
            state = {name: {k: join_fused(v, params[name]) if is_fused_entry(v) else v for k, v in entry.items()}
                     for name, entry in optimizer_state["state"].items()}
            set_optimizer_state_dict(module, optimizer, {**optimizer_state, "state": state})

    def sharded_entries(self, state):
        """The model, the optimizer and any plugin entry with DTensors in it (the ema plugin's average)."""
        return tuple(k for k, v in state.items() if k in ("model", "optimizer") or shards.holds_shards(v))

    def local(self, tensor):
        if is_fused_entry(tensor):  # a fused parameter's {q, k, v} (the ema plugin's, read back)
            dim = shard_dim(tensor["q"]) if shards.is_shard(tensor["q"]) else 0
            return torch.cat([shards.local(tensor[key]) for key in "qkv"], dim=dim)
        return shards.local(tensor)

    def shard_like(self, part, like):
        if id(like) in getattr(self, "fused_ids", ()):
            return split_fused(part, like)
        return shards.shard_like(part, like)

    def read_shards(self, template, directory):
        """:func:`~ddpx.strategies.shards.read_shards`; a plain tensor of ``template`` that the directory holds
        as a fused parameter's ``{q, k, v}`` (``ddpx export`` reads into the unsplit model) is read from its
        three parts."""
        stored = shards._reader_classes()[0](str(directory)).read_metadata().state_dict_metadata
        joins = []

        def expand(value, prefix):
            if isinstance(value, dict):
                return {k: expand(v, f"{prefix}.{k}") for k, v in value.items()}
            if torch.is_tensor(value) and not shards.is_shard(value) and prefix not in stored and \
                    all(f"{prefix}.{key}" in stored for key in "qkv"):
                part = tuple(stored[f"{prefix}.q"].size)  # a third of the output features (a Conv1D's dim 1)
                dim = next((d for d, n in enumerate(value.shape) if len(part) == value.dim() and n == 3 * part[d]
                            and value.shape[:d] + value.shape[d + 1:] == part[:d] + part[d + 1:]), None)
                if dim is not None:
                    parts = dict(zip("qkv", value.chunk(3, dim=dim)))  # views: the load fills ``value``
                    joins.append((value, parts, dim))
                    return parts
            return value

        expanded = {k: expand(v, k) for k, v in template.items()}
        read = shards.read_shards(expanded, directory)
        for value, parts, dim in joins:  # views: filled in place already; copied in case DCP replaced them
            value.copy_(torch.cat([parts[key] for key in "qkv"], dim=dim))
        for key in read:
            template[key] = _collapse(read[key], template[key])
        return {k: template[k] for k in read}

    def full_state_dict(self, module):
        """The whole model on rank 0 (every rank takes part: each split tensor is gathered over its
        tensor group), as plain CPU tensors in the user's layout (fused parameters un-permuted) and order."""
        rank0 = dist.get_rank() == 0
        whole = {}
        for key, value in module.state_dict().items():
            if shards.is_shard(value):
                dim = shard_dim(value) if key in self.fused else None
                value = value.full_tensor()
                if dim is not None:
                    value = unpermute_fused(value, self.size, dim)
            if rank0:
                whole[key] = value.detach().to("cpu", copy=True)
        return {k: whole[k] for k in self.key_order if k in whole} if rank0 else {}
