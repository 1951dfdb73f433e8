"""``trainer.strategy: pipeline``: consecutive blocks of the model on consecutive ranks, the
micro-batches of each batch flowing through them on ``torch.distributed.pipelining``'s schedules.

The split (ddpx/strategies/stages.py, :func:`~ddpx.strategies.stages.stage_ranges`): the model's repeated blocks (a transformer's layers, found as
fsdp finds them) are cut into ``pipeline.stages`` x ``pipeline.stages_per_rank`` contiguous
ranges, balanced by parameter count (``split: auto``) or before the blocks
``pipeline.split`` names. Each rank keeps the user's model with only its stages' blocks in the
blocks' container (``StageList``: the blocks keep their names, so state dicts, checkpoints
and ``model/`` carry the user's keys). What is not a block (embeddings, the final norm, the head,
tied or not) stays on every stage; its gradients are summed over the stages after each step
(a stage that does not use a parameter adds zero), so tied weights stay tied.

A stage runs the user's own ``forward`` on the micro-batch (``StageModule``): a stage after
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

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DdpxError
from ..fused_allreduce import fused_allreduce
from . import shards
from .base import PartReduction
from .ddp import DDPStrategy
from .fsdp import FSDPStrategy, mixed_precision, padded_forwards, param_count, reshard
from .mesh import model_parallel_mesh
from .stages import Reentrant, batch_rows, batch_signature, cut_model, split_batch

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


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
        self.stage_ids = [self.pp_rank + stages * k for k in range(per_rank)]  # interleaved: round robin
        self.num_stages = total
        module, self.stage_modules, mine, where = cut_model(module, total, split, self.stage_ids, trainer.loss_fn,
                                                            Reentrant(lambda: trainer.autocast))
        self._split_parameters(module, mine)
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
            self._split_parameters(module, mine)  # FSDP replaced them by DTensors
        elif self.dp_size > 1:
            preferred = self.compression[0].ddp_options() if self.compression else {}
            from .ddp import ddp_kwargs

            options = {**ddp_kwargs(trainer.config, preferred), "find_unused_parameters": True}  # the trunk
            wrapped = [torch.nn.parallel.DistributedDataParallel(
                self.stage_modules[0], process_group=self.dp_group,
                device_ids=[trainer.device] if trainer.device.type == "cuda" else None, **options)]
        self.pipeline_stages = lambda: [PipelineStage(m, v, total, trainer.device, group=self.pp_group)
                                        for m, v in zip(wrapped, self.stage_ids)]
        trainer.log.info(f"pipeline: {total} stages over {stages} ranks x {self.dp_size} replica{'s' if self.dp_size > 1 else ''}, "
                         f"{cfg.schedule} with {cfg.microbatches} micro-batches; this rank: stage"
                         f"{'s' if per_rank > 1 else ''} {', '.join(map(str, self.stage_ids))} ({where}, "
                         f"{sum(param_count(m) for _, m in mine)} block parameters)", )
        return wrapped[0]

    def _split_parameters(self, module, mine) -> None:
        """This rank's block parameters, and the trunk: every other parameter (on every stage)."""
        self.block_params = {id(p) for _, m in mine for p in m.parameters()}
        self.trunk = [p for p in module.parameters() if id(p) not in self.block_params]

    def _schedule(self, batch, train: bool):
        """The schedule for batches shaped as ``batch`` (a stage learns its activations' shapes at its
        first step, so each batch shape, a tail batch's too, and each of training and evaluation
        has its own) and its micro-batch count:
        ``pipeline.microbatches``, or for a batch it does not divide the largest divisor below it."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        key = (batch_signature(batch), train)
        if key not in self.schedules:
            cfg = self.trainer.config.pipeline
            rows = batch_rows(batch)
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
        if self.compression is not None and self.sharded:  # FSDP's reduce-scatter over the replicas
            return FSDPStrategy.install_compression(self, trainer, model)
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
        anything tied between them (fused into buckets: ``ddpx.fused_allreduce``)."""
        if not self.trunk:
            return
        # under fsdp replicas each holds its shard of a trunk gradient, laid out alike on every stage
        for p in self.trunk:
            if p.grad is None:
                p.grad = shards.shard_like(torch.zeros_like(shards.local(p)), p)
        fused_allreduce([shards.local(p.grad) for p in self.trunk], op="sum", process_group=self.pp_group,
                        async_op=False)

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


