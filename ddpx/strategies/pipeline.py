"""``trainer.strategy: pipeline``: consecutive blocks of the model on consecutive ranks, the
micro-batches of each batch flowing through them on ``torch.distributed.pipelining``'s schedules.

The split (:func:`stage_ranges`): the model's repeated blocks (a transformer's layers, found as
fsdp finds them) are cut into ``pipeline.stages`` x ``pipeline.stages_per_rank`` contiguous
ranges, balanced by parameter count (``split: auto``) or before the blocks
``pipeline.split`` names. Each rank keeps the user's model with only its stages' blocks in the
blocks' container (:class:`StageList`: the blocks keep their names, so state dicts, checkpoints
and ``model/`` carry the user's keys). What is not a block (embeddings, the final norm, the head,
tied or not) stays on every stage; its gradients are summed over the stages after each step
(a stage that does not use a parameter adds zero), so tied weights stay tied.

A stage runs the user's own ``forward`` on the micro-batch (:class:`StageModule`): a stage after
the first swaps the activation it received in as its first block's input, a stage before the
last ends the forward after its last block; the last stage computes the loss as under ddp
(the configured ``loss`` or the model's own). The batch never travels: every stage of a
data-parallel replica loads the same batches.

The mesh is ``(dp, pp)`` (ddpx/strategies/mesh.py): a pipeline's stages are consecutive ranks
(inside a node); with more ranks than stages, the replicas of each stage are one
``DistributedDataParallel`` group (``pipeline.data_parallel: ddp``, where every ddpx comm hook
compresses the gradients) or one FSDP2 mesh (``fsdp``: the stage sharded over its replicas,
the comm hooks with a sharded reduce-scatter).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DdpxError
from ..data.batches import model_loss
from . import shards
from .base import PartReduction
from .ddp import DDPStrategy
from .fsdp import FSDPStrategy, block_modules, mixed_precision, padded_forwards, param_count, reshard
from .mesh import model_parallel_mesh

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


class StageOutput(Exception):
    """Raised by a stage's last block to end the user's forward there, carrying the activation."""

    def __init__(self, value):
        super().__init__()
        self.value = value


class StageList(nn.ModuleList):
    """A stage's part of a ModuleList of blocks: the children keep their names (``"4"``, ``"5"``),
    and iterating, ``len`` and indexing (slices too) see only them."""

    def __init__(self, named=()):
        nn.Module.__init__(self)
        for name, module in named:
            self.add_module(name, module)

    def __getitem__(self, index):
        items = list(self._modules.values())
        return nn.ModuleList(items[index]) if isinstance(index, slice) else items[index]


class StageSequential(nn.Sequential):
    """A stage's part of a Sequential (its children keep their names; ``forward`` runs them in order)."""

    def __init__(self, named=()):
        nn.Module.__init__(self)
        for name, module in (named.items() if isinstance(named, dict) else named):
            self.add_module(name, module)


def _part(container: nn.Module, named: list) -> nn.Module:
    if isinstance(container, nn.Sequential):
        return StageSequential(named)
    if isinstance(container, nn.ModuleDict):
        return nn.ModuleDict(dict(named))
    return StageList(named)


def find_blocks(model: nn.Module) -> tuple[str, nn.Module, list]:
    """``(container path, container, its children as (name, module))`` of the model's repeated
    blocks; a model without one container of blocks is a one-line error listing its modules."""
    blocks = block_modules(model)
    parents = {name.rpartition(".")[0] for name, _ in blocks}
    if not blocks or len(parents) != 1:
        top = [name for name, _ in model.named_children()]
        found = f"blocks in {len(parents)} containers ({', '.join(sorted(parents))})" if blocks else \
            "no container of repeated blocks"
        raise DdpxError(f"trainer.strategy=pipeline cuts a model's repeated blocks (an nn.ModuleList or "
                        f"nn.Sequential of one block class) into stages, but {type(model).__name__} has {found}; "
                        f"its modules: {', '.join(top[:16])}; name where stages begin with pipeline.split=[...] "
                        "(e.g. [layers.2]), or use trainer.strategy=ddp or fsdp")
    path = parents.pop()
    container = model.get_submodule(path) if path else model
    return path, container, list(container.named_children())


def stage_ranges(model: nn.Module, stages: int, split) -> tuple[str, nn.Module, list, list]:
    """``(container path, container, its children, [(first, end) child index range per stage])``:
    ``split: auto`` balances the blocks' parameters over the stages (contiguous, the largest
    stage as small as it can be); a list names the blocks (``layers.4``) that begin stages 1, 2, ...
    Non-block children (an activation between blocks) go with the block before them."""
    path, container, children = find_blocks(model)
    block_names = {name for name, _ in block_modules(model)}
    prefix = f"{path}." if path else ""
    is_block = [prefix + name in block_names for name, _ in children]
    block_index = [i for i, b in enumerate(is_block) if b]
    if split == "auto":
        if stages > len(block_index):
            raise DdpxError(f"pipeline.stages x pipeline.stages_per_rank = {stages} stages, but "
                            f"{type(model).__name__} has {len(block_index)} blocks in {path or 'itself'} to cut; use at "
                            f"most {len(block_index)} stages")
        sizes = [param_count(children[i][1]) for i in block_index]
        starts = [block_index[i] for i in _balanced_cuts(sizes, stages)]
    else:
        names = [prefix + name for name, _ in children]
        unknown = [s for s in split if s not in names or not is_block[names.index(s)]]
        if unknown:
            raise DdpxError(f"pipeline.split names {', '.join(map(str, unknown))}, which is not a block of "
                            f"{type(model).__name__}; stages begin at blocks: "
                            f"{', '.join(names[i] for i in block_index[:12])}{', ...' if len(block_index) > 12 else ''}")
        starts = sorted(names.index(s) for s in split)
        if len(starts) != stages - 1 or starts[0] == block_index[0] or len(set(starts)) != len(starts):
            raise DdpxError(f"pipeline.split names {len(split)} blocks, but {stages} stages need {stages - 1} "
                            f"distinct blocks after the first ({names[block_index[0]]}) where stages 1..{stages - 1} "
                            "begin; or set pipeline.split=auto")
        starts = [0, *starts]
    starts[0] = 0  # what comes before the first block belongs to stage 0
    ranges = [(a, b) for a, b in zip(starts, [*starts[1:], len(children)])]
    return path, container, children, ranges


def _balanced_cuts(sizes: list, parts: int) -> list:
    """The first index of each of ``parts`` contiguous groups of ``sizes`` whose largest sum is
    smallest (a binary search over that largest sum, greedy fill); each group non-empty."""
    def cuts_for(limit):
        cuts, total = [0], 0
        for i, size in enumerate(sizes):
            if total + size > limit and total > 0:
                cuts.append(i)
                total = 0
            total += size
        return cuts

    low, high = max(sizes), sum(sizes)
    while low < high:
        mid = (low + high) // 2
        if len(cuts_for(mid)) <= parts:
            high = mid
        else:
            low = mid + 1
    cuts = cuts_for(low)
    for i in range(len(sizes) - 1, 0, -1):  # fewer groups than parts: split the tail one by one
        if len(cuts) >= parts:
            break
        if i not in cuts:
            cuts.append(i)
            cuts.sort()
    return cuts


def _with_container(model: nn.Module, path: str, container: nn.Module) -> nn.Module:
    """A shallow copy of ``model`` whose module at ``path`` is ``container``; everything else is
    the same objects (their parameters shared)."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    head, _, rest = path.partition(".")
    view._modules[head] = container if not rest else _with_container(model._modules[head], rest, container)
    return view


def split_batch(batch, chunks: int) -> list:
    """``batch`` as ``chunks`` micro-batches: every tensor split along dim 0, containers
    recursed into, anything else repeated."""
    if isinstance(batch, torch.Tensor):
        return list(batch.tensor_split(chunks)) if batch.dim() else [batch] * chunks
    if isinstance(batch, (list, tuple)):
        parts = [split_batch(b, chunks) for b in batch]
        return [type(batch)(p[i] for p in parts) if not hasattr(batch, "_fields") else type(batch)(*(p[i] for p in parts))
                for i in range(chunks)]
    if isinstance(batch, dict):
        parts = {k: split_batch(v, chunks) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(chunks)]
    return [batch] * chunks


def _batch_rows(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 0
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((n for n in map(_batch_rows, items) if n), 0)


def _signature(batch):
    if isinstance(batch, torch.Tensor):
        return tuple(batch.shape), batch.dtype
    if isinstance(batch, dict):
        return tuple((k, _signature(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return tuple(_signature(b) for b in batch)
    return type(batch).__name__


class StageModule(nn.Module):
    """One pipeline stage: the user's model (``view``, holding this stage's blocks) run on the
    micro-batches :meth:`feed` gives. Its forward takes what the schedule passes (the previous stage's
    activation, or a placeholder on the first stage) and returns the activation for the next
    stage, or on the last stage the loss divided by the micro-batches of the whole window."""

    def __init__(self, view: nn.Module, blocks: list, first: bool, last: bool, loss_fn, autocast):
        super().__init__()
        self.view = view
        self.first, self.last = first, last
        self.loss_fn, self.autocast = loss_fn, autocast
        self.chunks, self.next, self.window, self.keep_outputs, self.inferring = [], 0, 1.0, False, False
        self.results: list = []  # last stage: (loss, outputs, targets) per micro-batch, detached
        self.incoming: Optional[torch.Tensor] = None
        if not first:
            blocks[0].register_forward_pre_hook(self._swap_input, with_kwargs=True)
        if not last:
            blocks[-1].register_forward_hook(self._stop)

    def feed(self, chunks: list, window: float, keep_outputs: bool, inferring: bool) -> None:
        self.chunks, self.next, self.window, self.keep_outputs, self.inferring = chunks, 0, window, keep_outputs, inferring
        self.results = []

    def _swap_input(self, module, args, kwargs):
        if args:
            return (self.incoming, *args[1:]), kwargs
        key = next(iter(kwargs))  # called with keywords only: the first is the hidden state
        return args, {**kwargs, key: self.incoming}

    @staticmethod
    def _stop(module, args, output):
        raise StageOutput(output[0] if isinstance(output, (tuple, list)) else output)

    def forward(self, *args):
        # args: a placeholder on the first stage, the previous stage's activation after it. A new
        # schedule's first step runs one forward of each stage of its own to learn the shapes
        # (torch.distributed.pipelining's dynamic metadata): that one takes micro-batch 0 and
        # counts for nothing.
        learning = self.inferring
        if learning:
            self.inferring, batch = False, self.chunks[0]
        else:
            batch = self.chunks[self.next]
            self.next += 1
        self.incoming = None if self.first else args[0]
        try:
            with self.autocast:
                loss, outputs, targets = model_loss(self.view, self.loss_fn, batch)
        except StageOutput as out:
            return out.value
        finally:
            self.incoming = None
        if not learning:
            self.results.append((loss.detach(), outputs if self.keep_outputs else None, targets))
        return loss / self.window if self.window > 1 else loss


class PipelineStrategy(DDPStrategy):
    """Each rank holds one stage of the model (``pipeline.stages_per_rank``: several, interleaved)."""

    replicated = False
    compression_advice = ("compress the data-parallel gradients with comm_hook.name=int8 (or bf16, fp16, powersgd); "
                          "a pipeline's activations between stages are not compressed")

    @classmethod
    def check_config(cls, values):
        cfg, trainer = values.get("pipeline", {}), values.get("trainer", {})
        stages, micro, per_rank = cfg.get("stages", 2), cfg.get("microbatches", 4), cfg.get("stages_per_rank", 1)
        schedule = cfg.get("schedule", "1f1b")
        if stages < 2:
            raise DdpxError(f"pipeline.stages={stages}: a pipeline needs at least 2 stages; with 1 every rank holds the "
                            "whole model: set trainer.strategy=ddp")
        if per_rank > 1 and schedule != "interleaved_1f1b":
            raise DdpxError(f"pipeline.stages_per_rank={per_rank} needs pipeline.schedule=interleaved_1f1b (now "
                            f"{schedule}); or set pipeline.stages_per_rank=1")
        if schedule == "interleaved_1f1b" and per_rank < 2:
            raise DdpxError("pipeline.schedule=interleaved_1f1b gives each rank several stages: set "
                            "pipeline.stages_per_rank=2 (or more), or pipeline.schedule=1f1b")
        batch = trainer.get("batch_size", 1)
        if batch % micro:
            raise DdpxError(f"trainer.batch_size={batch} does not split into pipeline.microbatches={micro} equal "
                            f"micro-batches; set trainer.batch_size to a multiple of {micro}, or pipeline.microbatches to "
                            f"a divisor of {batch}")
        amp = values.get("amp", {})
        if amp.get("enabled") and amp.get("dtype") == "fp16":
            raise DdpxError("amp.dtype=fp16 does not apply under trainer.strategy=pipeline: each stage's GradScaler would "
                            "skip overflowing steps on its own and the stages would part; use amp.dtype=bf16 (no "
                            "loss scaling), or amp.enabled=false")
        if values.get("trainer", {}).get("compile"):
            raise DdpxError("trainer.compile does not apply under trainer.strategy=pipeline (the stages run the model "
                            "piece by piece); set trainer.compile=false")

    @classmethod
    def check_compression(cls, config, method, options):
        if config.pipeline.data_parallel == "fsdp":
            FSDPStrategy.check_compression(config, method, options)
        else:
            super().check_compression(config, method, options)
        if config.pipeline.stages_per_rank > 1:
            raise DdpxError(f"comm_hook.name={method.name} does not apply with pipeline.stages_per_rank="
                            f"{config.pipeline.stages_per_rank}: an interleaved pipeline runs without data-parallel "
                            "replicas here, so there is nothing to compress; set comm_hook.name=allreduce, or "
                            "pipeline.stages_per_rank=1 (schedule 1f1b or gpipe)")

    def _install_ddp_compression(self, trainer, model):
        if self.compression is not None and self.dp_size == 1:
            if trainer.rank == 0:
                trainer.log.info(f"comm_hook.name={self.compression[0].name} has nothing to compress: {trainer.world_size} "
                                 f"ranks make one pipeline of {self.trainer.config.pipeline.stages} stages, with no "
                                 "data-parallel replicas to exchange gradients with (it compresses across pipelines)")
            return None
        return super().install_compression(trainer, model)

    # --- building ------------------------------------------------------------------------

    def wrap(self, trainer, module):
        from torch.distributed.pipelining import PipelineStage

        cfg = trainer.config.pipeline
        stages, per_rank = cfg.stages, cfg.stages_per_rank
        self.key_order = list(module.state_dict())  # the whole model's, for model/ and exports
        self.mesh = model_parallel_mesh(trainer, stages, "pp", "pipeline.stages")
        self.pp_group, self.dp_group = self.mesh.get_group("pp"), self.mesh.get_group("dp")
        self.pp_rank, self.dp_rank = self.mesh.get_local_rank("pp"), self.mesh.get_local_rank("dp")
        self.dp_size = self.mesh.size(0)
        if per_rank > 1 and self.dp_size > 1:
            raise DdpxError(f"pipeline.stages_per_rank={per_rank} (interleaved) runs without data-parallel replicas "
                            f"here, but {trainer.world_size} ranks make {self.dp_size} pipelines of {stages} stages; "
                            f"start {stages} ranks, or set pipeline.stages_per_rank=1")
        total = stages * per_rank
        split = cfg.split if cfg.split == "auto" else [str(name) for name in cfg.split]  # [2, 4]: a Sequential's
        path, container, children, ranges = stage_ranges(module, total, split)
        self.stage_ids = [self.pp_rank + stages * k for k in range(per_rank)]  # interleaved: round robin
        self.num_stages = total
        mine = [children[i] for v in self.stage_ids for i in range(*ranges[v])]
        union = _part(container, mine)
        if path:
            parent, _, leaf = path.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, leaf, union)
        else:  # the model is the container (a Sequential): it keeps this rank's blocks in place, for it is
            module._modules.clear()  # trainer.module, whose state dict, optimizer and model/ are this rank's part
            module._modules.update(union._modules)
        self.block_params = {id(p) for _, m in mine for p in m.parameters()}
        self.trunk = [p for p in module.parameters() if id(p) not in self.block_params]
        self.stage_modules = []
        for v in self.stage_ids:
            named = children[ranges[v][0]:ranges[v][1]]
            view = module if per_rank == 1 else \
                _with_container(module, path, _part(container, named)) if path else _part(container, named)
            blocks = [m for name, m in named]  # the stage ends after its last child (an activation too)
            self.stage_modules.append(StageModule(view, blocks, v == 0, v == total - 1, trainer.loss_fn,
                                                  _Reentrant(lambda: trainer.autocast)))
        self.holds_last = self.stage_ids[-1] == total - 1
        self.last_pp_rank = (total - 1) % stages
        self.schedules: dict = {}
        self.syncing = True
        self.trainer = trainer
        wrapped = self.stage_modules
        self.sharded = self.dp_size > 1 and cfg.data_parallel == "fsdp"
        if self.sharded:
            # FSDP2 over the replicas, each block a unit, the stage the root. The parameters are
            # gathered by a step's first forward and kept until its last backward (ZeRO-2): the
            # replicas' tail batches may split into different numbers of micro-batches, and the
            # first forward of a new batch shape runs once more (see StageModule), so a gather per
            # forward would not line up across replicas.
            from torch.distributed.fsdp import fully_shard

            dp_mesh, policy = self.mesh["dp"], mixed_precision(trainer.config)
            for _, child in mine:
                if param_count(child) > 0:
                    fully_shard(child, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
            fully_shard(self.stage_modules[0], mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
            # FSDP replaced the parameters by DTensors: the block/trunk split by identity again
            self.block_params = {id(p) for _, m in mine for p in m.parameters()}
            self.trunk = [p for p in module.parameters() if id(p) not in self.block_params]
        elif self.dp_size > 1:
            preferred = self.compression[0].ddp_options() if self.compression else {}
            from .ddp import ddp_kwargs

            options = {**ddp_kwargs(trainer.config, preferred), "find_unused_parameters": True}  # the trunk
            wrapped = [torch.nn.parallel.DistributedDataParallel(
                self.stage_modules[0], process_group=self.dp_group,
                device_ids=[trainer.device] if trainer.device.type == "cuda" else None, **options)]
        self.pipeline_stages = lambda: [PipelineStage(m, v, total, trainer.device, group=self.pp_group)
                                        for m, v in zip(wrapped, self.stage_ids)]
        first, last = ranges[self.stage_ids[0]], ranges[self.stage_ids[-1]]
        names = [f"{path + '.' if path else ''}{children[i][0]}" for i in (first[0], last[1] - 1)]
        trainer.log.info(f"pipeline: {total} stages over {stages} ranks x {self.dp_size} replica{'s' if self.dp_size > 1 else ''}, "
                         f"{cfg.schedule} with {cfg.microbatches} micro-batches; this rank: stage"
                         f"{'s' if per_rank > 1 else ''} {', '.join(map(str, self.stage_ids))} ({names[0]}..{names[1]}, "
                         f"{sum(param_count(m) for _, m in mine)} block parameters)", )
        return wrapped[0]

    def _schedule(self, batch, train: bool):
        """The schedule for batches shaped as ``batch`` (a stage learns its activations' shapes at its
        first step, so each batch shape, a tail batch's too, and each of training and evaluation
        has its own) and its micro-batch count:
        ``pipeline.microbatches``, or for a batch it does not divide the largest divisor below it."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        key = (_signature(batch), train)
        if key not in self.schedules:
            cfg = self.trainer.config.pipeline
            rows = _batch_rows(batch)
            micro = max(m for m in range(1, min(cfg.microbatches, max(rows, 1)) + 1) if rows % m == 0 or rows == 0)
            stages = self.pipeline_stages()
            loss_fn = self._scaled_loss
            if cfg.schedule == "interleaved_1f1b":
                schedule = ScheduleInterleaved1F1B(stages, micro, loss_fn=loss_fn, scale_grads=False)
            else:
                kind = ScheduleGPipe if cfg.schedule == "gpipe" or micro < cfg.stages else Schedule1F1B
                schedule = kind(stages[0], micro, loss_fn=loss_fn, scale_grads=False)
            self.schedules[key] = (schedule, micro)
        return self.schedules[key]

    def _scaled_loss(self, output, target):
        return self.trainer.scaler.scale(output)

    def install_compression(self, trainer, model):
        if self.compression is not None and self.dp_size == 1:  # one line, not "not wrapped in DDP" from every rank
            if trainer.is_main:
                stages, name = trainer.config.pipeline.stages, self.compression[0].name
                trainer.log.warning(f"comm_hook.name={name} ignored: the pipeline's stages have one replica each, "
                                    "so no gradients are averaged over data-parallel ranks; start "
                                    f"{2 * stages}, {3 * stages}, ... ranks (replicas of each stage) to compress "
                                    "theirs, or set comm_hook.name=allreduce")
            return None
        return super().install_compression(trainer, model)

    # --- the step ------------------------------------------------------------------------

    def data_parallel(self, trainer):
        return self.dp_rank, self.dp_size

    def counts_loss(self, trainer):
        return self.holds_last

    def describe_rank(self, trainer):
        if not hasattr(self, "stage_ids"):  # not wrapped yet
            return ""
        stages = "stages " + ", ".join(map(str, self.stage_ids)) if len(self.stage_ids) > 1 else \
            f"stage {self.stage_ids[0]}"
        return f"pipeline {stages} of {self.num_stages}, replica {self.dp_rank} of {self.dp_size}"

    def _run(self, batch, window, train: bool):
        schedule, micro = self._schedule(batch, train)
        chunks = split_batch(batch, micro)
        fresh = not getattr(schedule, "_stage_forward_initialized", getattr(schedule, "_stages_forward_initialized", True))
        for stage in self.stage_modules:
            # the loss back-propagated is divided by the micro-batches here, not by the schedule's
            # scale_grads, which would divide what earlier batches of an accumulation window left too
            stage.feed(chunks, window * micro, keep_outputs=not train, inferring=fresh)
        device = self.trainer.device
        args = (torch.zeros(micro, 1, device=device),) if self.stage_ids[0] == 0 else ()
        target = torch.zeros(micro, device=device) if self.holds_last else None
        if train:
            schedule.step(*args, target=target, return_outputs=False)
        else:
            schedule.eval(*args, target=target, return_outputs=False)
        return self.stage_modules[-1].results if self.holds_last else []

    def forward_backward(self, trainer, batch, window):
        results = self._run(batch, window, train=True)
        loss = torch.stack([r[0] for r in results]).float().mean() if results else \
            torch.zeros((), device=trainer.device)
        dist.broadcast(loss, group=self.pp_group, group_src=self.last_pp_rank)  # every stage shows the loss
        if self.syncing:
            self._reduce_trunk()
        return loss

    def _reduce_trunk(self) -> None:
        """Sum the non-block parameters' gradients over the stages (a stage that does not use one
        adds zero): every stage then holds the whole gradient of the embeddings, the head and
        anything tied between them. One all_reduce."""
        if not self.trunk:
            return
        # under fsdp replicas each holds its shard of a trunk gradient, laid out alike on every stage
        grads = [shards.local(p.grad) if p.grad is not None else torch.zeros_like(shards.local(p)) for p in self.trunk]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.pp_group)
        offset = 0
        for p, g in zip(self.trunk, grads):
            part = flat[offset:offset + g.numel()].view_as(g)
            if p.grad is None:
                p.grad = shards.shard_like(part.clone(), p)
            else:
                g.copy_(part)
            offset += g.numel()

    def install_compression(self, trainer, model):
        if self.compression is not None and self.sharded:
            return FSDPStrategy.install_compression(self, trainer, model)
        return self._install_ddp_compression(trainer, model)

    def no_sync(self, model):
        """An accumulation window's backward passes but the last: the stages run on the unwrapped
        module (DDP's reducer then stays idle) and the trunk is not summed yet."""
        @contextlib.contextmanager
        def unsynced():
            self.syncing = False
            saved = {}
            for key, (schedule, _) in self.schedules.items():
                for stage in _stages_of(schedule):
                    saved[id(stage)] = (stage, stage.submod)
                    stage.submod = getattr(stage.submod, "module", stage.submod)
            try:
                yield
            finally:
                self.syncing = True
                for stage, submod in saved.values():
                    stage.submod = submod

        return unsynced

    def part_reduction(self, module):
        """A block's gradient lives on one stage: the squares are summed over the stages; the trunk's
        is the same on every stage after :meth:`_reduce_trunk` and counted once."""
        blocks, stages = self.block_params, self.trainer.config.pipeline.stages
        if self.sharded:  # every gradient a part (sharded over the replicas); the trunk's the same on every stage
            group, holds, share = None, (lambda p: True), (lambda p: 1.0 if id(p) in blocks else 1.0 / stages)
        else:
            group, holds, share = self.pp_group, (lambda p: id(p) in blocks), None

        def reduce(tensor, op):
            dist.all_reduce(tensor, op=op, group=group)

        return PartReduction(holds_part=holds, reduce=reduce, device=self.trainer.device, share=share)

    # --- evaluation ------------------------------------------------------------------------

    @contextlib.contextmanager
    def evaluating(self, trainer, loader):
        """Under fsdp replicas the first forward gathers the parameters across them, so every
        replica needs an evaluation batch (fsdp's check); afterwards they are freed."""
        if not self.sharded:
            yield 0
            return
        yield padded_forwards(trainer, loader)
        reshard(self.stage_modules[0])

    def eval_loss(self, trainer, model, batch):
        results = self._run(batch, 1.0, train=False)
        if not results:
            return torch.zeros((), device=trainer.device), None, None
        loss = torch.stack([r[0] for r in results]).float().mean()
        outputs = [r[1] for r in results]
        targets = [r[2] for r in results]
        cat = (lambda xs: torch.cat(xs) if all(isinstance(x, torch.Tensor) and x.dim() for x in xs) else None)
        return loss, cat(outputs), cat(targets)

    # --- state -----------------------------------------------------------------------------

    def model_state(self, module, optimizer):
        """This rank's stages, keyed by the user's names; the optimizer's state keyed by parameter
        name and its groups' settings without their parameter lists (which differ by stage)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(module, optimizer)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer_state["param_groups"]]
        return model_state, {"state": optimizer_state["state"], "param_groups": groups}

    def load_model_state(self, module, optimizer, model_state, optimizer_state):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        if model_state is not None:
            module.load_state_dict(model_state)
        if optimizer_state is not None:
            current = get_optimizer_state_dict(module, optimizer)
            groups = [{**saved, "params": group["params"]}
                      for saved, group in zip(optimizer_state["param_groups"], current["param_groups"])]
            set_optimizer_state_dict(module, optimizer, {"state": optimizer_state["state"], "param_groups": groups})

    def sharded_entries(self, state):
        """The model, the optimizer and any entry keyed by this rank's parameter names (the ema plugin's
        average of its stages): read back by name, at any layout. Per rank, a resume on other ranks would
        hand every rank rank 0's stages."""
        names = {name for name, _ in self.trainer.module.named_parameters()}
        return tuple(k for k, v in state.items() if k in ("model", "optimizer") or _keyed_by(v, names))

    def full_state_dict(self, module):
        """Every stage's part gathered on the first replica's rank 0 (the stages of every replica
        take part), as plain CPU tensors, in the model's own order."""
        part = {k: (v.full_tensor() if shards.is_shard(v) else v).detach().to("cpu", copy=True)
                for k, v in module.state_dict().items()}  # fsdp replicas gather (the same keys on each)
        parts = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(parts, part if self.dp_rank == 0 else {}, group=self.pp_group)
        if dist.get_rank() != 0:
            return {}
        whole = {k: v for p in parts for k, v in p.items()}
        return {k: whole[k] for k in self.key_order if k in whole}


def _keyed_by(value, names: set) -> bool:
    """Whether ``value`` (a state entry: nested dicts) holds a dict of tensors keyed by ``names``."""
    if not isinstance(value, dict):
        return False
    tensors = [v for v in value.values() if isinstance(v, torch.Tensor)]
    if tensors and len(tensors) == len(value) and set(value) <= names:
        return True
    return any(_keyed_by(v, names) for v in value.values())


def _stages_of(schedule) -> list:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


class _Reentrant:
    """The trainer's autocast context, looked up when entered (the amp plugin sets it after the wrap)."""

    def __init__(self, get):
        self.get = get
        self.active = []

    def __enter__(self):
        context = self.get()
        self.active.append(context)
        return context.__enter__()

    def __exit__(self, *exc):
        return self.active.pop().__exit__(*exc)
