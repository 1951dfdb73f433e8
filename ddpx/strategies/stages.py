"""How a pipeline cuts the user's model into stages and runs one stage
(``trainer.strategy: pipeline``, ddpx/strategies/pipeline.py).

:func:`stage_ranges`: the model's repeated blocks (a transformer's layers, found as fsdp finds
them) cut into contiguous ranges, balanced by parameter count or where ``pipeline.split`` says.
:func:`cut_model`: each rank keeps the user's model with only its stages' blocks in the blocks'
container (:class:`StageList`: the blocks keep their names, so state dicts, checkpoints and
``model/`` carry the user's keys); what is not a block stays. :class:`StageModule`: one stage
runs the user's own ``forward`` on a micro-batch, with the received activation swapped in as
its first block's input and the forward ended after its last child.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from ..data.batches import model_loss
from ..errors import DdpxError
from .fsdp import block_modules, param_count


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


def batch_rows(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 0
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((n for n in map(batch_rows, items) if n), 0)


def batch_signature(batch):
    if isinstance(batch, torch.Tensor):
        return tuple(batch.shape), batch.dtype
    if isinstance(batch, dict):
        return tuple((k, batch_signature(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return tuple(batch_signature(b) for b in batch)
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


def cut_model(module: nn.Module, total: int, split, stage_ids: list, loss_fn, autocast) -> tuple:
    """Keep this rank's stages (``stage_ids`` of ``total``) of ``module``'s blocks in place, the rest
    dropped; returns ``(the model, a StageModule per stage, this rank's children as (name, module),
    "first..last" child names)``. With several stages per rank each runs on a view of the model
    holding only its own blocks."""
    path, container, children, ranges = stage_ranges(module, total, split)
    mine = [children[i] for v in stage_ids for i in range(*ranges[v])]
    union = _part(container, mine)
    if path:
        parent, _, leaf = path.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, leaf, union)
    else:  # the model is the container (a Sequential): it keeps this rank's blocks in place, for it is
        module._modules.clear()  # trainer.module, whose state dict, optimizer and model/ are this rank's part
        module._modules.update(union._modules)
    stage_modules = []
    for v in stage_ids:
        named = children[ranges[v][0]:ranges[v][1]]
        view = module if len(stage_ids) == 1 else \
            _with_container(module, path, _part(container, named)) if path else _part(container, named)
        blocks = [m for _, m in named]  # the stage ends after its last child (an activation too)
        stage_modules.append(StageModule(view, blocks, v == 0, v == total - 1, loss_fn, autocast))
    first, last = ranges[stage_ids[0]], ranges[stage_ids[-1]]
    where = "..".join(f"{path + '.' if path else ''}{children[i][0]}" for i in (first[0], last[1] - 1))
    return module, stage_modules, mine, where


class Reentrant:
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
