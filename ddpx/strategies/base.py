"""The strategy contract: what one way of splitting the work means for every part of a run.

The trainer and the built-in plugins never ask which strategy runs; they ask the run's
strategy object (``trainer.strategy``) what they need:

===========================  ===================================================================
asked by                     the question (the method)
===========================  ===================================================================
the launcher, every rank     can this config work (:meth:`Strategy.check_config`), this
                             compression (:meth:`Strategy.check_compression`)
the trainer's default wrap   wrap the model (:meth:`Strategy.wrap`)
the comm_hook plugin         use a compression method (:meth:`Strategy.use_compression`, before
                             the wrap) and install it (:meth:`Strategy.install_compression`)
the trainer                  a step begins (:meth:`Strategy.begin_step`) and whether it counts
                             (:meth:`Strategy.commit_step`): live recovery's quorum and commit;
                             training starts (:meth:`Strategy.start`); one micro-batch's forward
                             and backward (:meth:`Strategy.forward_backward`); the context that
                             skips synchronisation in an accumulation window (:meth:`Strategy.no_sync`);
                             what must agree across ranks at an epoch's end
                             (:meth:`Strategy.replica_checks`); the model's and optimizer's state
                             (:meth:`Strategy.model_state`, :meth:`Strategy.load_model_state`)
the gradient norm            which gradients each rank holds a part of, and how their squares are
                             summed (:meth:`Strategy.part_reduction`)
the default evaluation       forwards every rank must run, and the clean-up after
                             (:meth:`Strategy.evaluating`); one batch's loss (:meth:`Strategy.eval_loss`)
the sampler, seeding         which data-parallel replica this rank belongs to
                             (:meth:`Strategy.data_parallel`); the training sampler's class
                             (:meth:`Strategy.batch_sampler_class`)
the loss means               whether this rank's losses count (:meth:`Strategy.counts_loss`)
failure lines                where this rank sits in the model (:meth:`Strategy.describe_rank`)
the checkpoint plugin        which state entries are each rank's own part, written by every rank
                             (:meth:`Strategy.sharded_entries`, :meth:`Strategy.save_shards`,
                             :meth:`Strategy.read_shards`); the whole model as one state dict
                             (:meth:`Strategy.full_state_dict`)
the ema plugin               whether every rank holds the same whole model
                             (:attr:`Strategy.replicated`), this rank's part of a tensor
                             (:meth:`Strategy.local`, :meth:`Strategy.shard_like`)
the comm monitor             what compresses the gradients here (:attr:`Strategy.compression_advice`)
memory reports               what this rank holds (:meth:`Strategy.memory`)
===========================  ===================================================================

The defaults below are those of a strategy whose every rank holds the whole model, the
same on every rank between steps (``replicated``); a strategy subclasses this class and
overrides what differs. docs/strategies.md shows a whole one (local SGD, about 60 lines).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, Mapping, Optional

import torch
from torch import nn

from ..errors import DdpxError
from . import shards

if TYPE_CHECKING:  # imported only for the annotations
    from ..train.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class PartReduction:
    """How a strategy whose ranks hold parts of some gradients sums over them: ``holds_part(p)``
    says whether parameter ``p``'s gradient is split over ranks, ``reduce(tensor, op)``
    all-reduces ``tensor`` in place over the ranks holding the parts (every rank calls it), on
    ``device`` (where the strategy's collectives run). ``share(p)``: the weight of ``p``'s part
    in that sum, for a part that several of those ranks hold alike (a pipeline's trunk, sharded
    over the replicas and the same on every stage: 1/stages); None: every part counts once."""

    holds_part: Callable[[torch.Tensor], bool]
    reduce: Callable[[torch.Tensor, object], None]
    device: torch.device
    share: Optional[Callable[[torch.Tensor], float]] = None


class EpochMoved(Exception):
    """Raised by :meth:`Strategy.begin_step` when the run's state was replaced by one in another
    epoch (live recovery healed this group from a peer): the trainer's loop starts that epoch."""


class Strategy:
    """One run's strategy. Made from the config on every rank before the process group exists
    (``ddpx.strategies.make``); ``name`` is what ``trainer.strategy`` named it by."""

    #: Every rank holds the same whole model and optimizer state between steps: checkpoints
    #: take them from rank 0, the ranks' weights are compared at an epoch's end, the EMA is one
    #: copy. False: each rank holds its part, written into the checkpoint by every rank.
    replicated = True
    #: Config sections this strategy reads, with their defaults: ``{section: {key: default}}``
    #: (a key's type is its default's, as for a plugin's ``ddpx_config_defaults``).
    config_defaults: Mapping[str, Mapping] = {}
    #: How to compress the gradients here, for the comm monitor's advice.
    compression_advice = "compress the gradients with comm_hook.name=fp16, bf16, int8 or onebit"

    def __init__(self, config):
        self.config = config
        self.name = config.trainer.strategy
        self.compression = None  # (method, options, native) asked by use_compression

    # --- before anything distributed: one-line errors ---------------------------------------

    @classmethod
    def check_config(cls, values: Mapping) -> None:
        """Refuse a config this strategy cannot run (``values``: the whole validated config as
        plain dicts), with a :class:`~ddpx.errors.DdpxError`. In the launcher and on every rank."""

    @classmethod
    def check_compression(cls, config, method, options: Mapping) -> None:
        """Refuse compression ``method`` (a ``ddpx.comm_hooks.Method``) with ``options`` where it cannot
        work under this strategy (unknown options included). Default: refused, there is no gradient
        exchange to compress."""
        raise DdpxError(f"comm_hook.name={method.name} does not apply under trainer.strategy="
                        f"{config.trainer.strategy}: it has no gradient exchange a comm hook could compress; remove "
                        "comm_hook.name (or set it to allreduce)")

    # --- building ------------------------------------------------------------------------

    def wrap(self, trainer: "Trainer", module: nn.Module) -> nn.Module:
        """The model as this strategy trains it (the default ``ddpx_wrap_model``)."""
        raise NotImplementedError(f"strategy {type(self).__qualname__} must implement wrap(trainer, module)")

    def use_compression(self, method, options: Mapping, native: bool) -> None:
        """Compress the gradients with ``method`` (asked before :meth:`wrap`, which may size its
        buckets for it; :meth:`check_compression` accepted it when the config was read):
        kept in ``compression`` for :meth:`install_compression`."""
        self.compression = (method, dict(options), native)

    def install_compression(self, trainer: "Trainer", model: nn.Module):
        """Install what :meth:`use_compression` asked for on the wrapped ``model``; returns its
        state (a ``ddpx.comm_hooks.CommState``: ``stats()``, ``state_dict()``, ``pair(optimizer)``),
        or None."""
        return None

    def start(self, trainer: "Trainer") -> None:
        """Training starts (a checkpoint was restored): schedule periodic work here with
        ``trainer.call_at_step``."""

    # --- the data and the ranks ------------------------------------------------------------

    def data_parallel(self, trainer: "Trainer") -> tuple[int, int]:
        """``(replica, replicas)``: the data-parallel replica this rank belongs to and how many there
        are. Data is sharded over the replicas, and a replica's ranks (a pipeline's stages, a tensor
        group) see the same batches and share their random stream. Default: every rank a replica."""
        return trainer.rank, trainer.world_size

    def batch_sampler_class(self) -> type:
        """The class of the training loader's batch sampler (the sampler plugin builds it with the
        replica and the replicas of :meth:`data_parallel`)."""
        from ..data.sampler import ResumableDistributedBatchSampler

        return ResumableDistributedBatchSampler

    def counts_loss(self, trainer: "Trainer") -> bool:
        """Whether this rank's losses and evaluation sums count in the means over the ranks: one rank
        per replica must (a pipeline's last stage; one rank of a tensor group, whose ranks repeat the
        same loss). Default: every rank."""
        return True

    def describe_rank(self, trainer: "Trainer") -> str:
        """Where this rank sits, for failure lines ("stage 1 of 2, replica 0"); empty: nothing to add
        (also before :meth:`wrap` placed it: a failure may come first)."""
        return ""

    # --- the step ------------------------------------------------------------------------

    def begin_step(self, trainer: "Trainer") -> None:
        """Before a step draws its batches. Live recovery takes the quorum here; it may replace the
        whole state (a heal: then :meth:`~ddpx.train.trainer.Trainer.restart_batches`, or
        :class:`EpochMoved`). Default: nothing."""

    def commit_step(self, trainer: "Trainer", micro_batches: int) -> bool:
        """After the backward passes of a step of ``micro_batches``, before the optimizer step:
        whether the step counts. False (live recovery: another replica group failed during it): the
        trainer drops its gradients and does not count it. Default: True."""
        return True

    def forward_backward(self, trainer: "Trainer", batch, window: float) -> torch.Tensor:
        """Forward (``ddpx_forward``, in ``autocast``) and backward of one micro-batch (on the
        device); returns its loss, detached. The back-propagated loss is divided by ``window``
        (see :meth:`ddpx.train.trainer.Trainer.forward_backward`)."""
        with trainer.autocast:
            loss = trainer.hook.ddpx_forward(trainer=trainer, batch=batch)
        trainer.backward(loss / window if window > 1 else loss)
        return loss.detach()

    def no_sync(self, model: nn.Module) -> Optional[Callable[[], ContextManager]]:
        """A factory of the context the backward passes of an accumulation window run in, all but
        the last (their gradients are not communicated); None: nothing to skip."""
        return None

    def replica_checks(self, module: nn.Module) -> dict:
        """``{what: (0-dim tensor, hint)}`` that must be equal on every rank at an epoch's end (one
        all_reduce compares them; ``hint`` says what to do when they are not)."""
        if not self.replicated:
            return {}
        weights = torch.stack([p.detach().sum(dtype=torch.float64) for p in module.parameters()]).sum()
        return {"sum of the weights": (weights, ": the replicas drifted apart, so some rank applied another update "
                                                "(with trainer.static_graph: true the set of parameters a step uses "
                                                "must not change between steps; a plugin may change weights on some "
                                                "ranks only)")}

    def part_reduction(self, module: nn.Module) -> Optional[PartReduction]:
        """How the squares of gradient parts are summed for the total gradient norm; None: every
        rank holds whole gradients (the norm needs no collective)."""
        return None

    # --- evaluation ------------------------------------------------------------------------

    @contextlib.contextmanager
    def evaluating(self, trainer: "Trainer", loader) -> Iterator[int]:
        """Around the default evaluation of ``loader``: yields how many forwards this rank runs
        beyond its batches (repeating its last one, results not counted) so that the ranks
        stay in step where every forward is collective."""
        yield 0

    def eval_loss(self, trainer: "Trainer", model: nn.Module, batch) -> tuple:
        """``(loss, outputs, targets)`` of one evaluation batch (on the device, under ``no_grad``):
        :func:`~ddpx.data.batches.model_loss`. A rank whose loss does not count
        (:meth:`counts_loss`) may return anything."""
        from ..data.batches import model_loss

        return model_loss(model, trainer.loss_fn, batch)

    # --- state -----------------------------------------------------------------------------

    def model_state(self, module: nn.Module, optimizer) -> tuple[dict, dict]:
        """The model's and the optimizer's state as a checkpoint holds them."""
        return module.state_dict(), optimizer.state_dict()

    def load_model_state(self, module: nn.Module, optimizer, model_state: Optional[dict],
                         optimizer_state: Optional[dict]) -> None:
        """Put back what :meth:`model_state` returned; a part that is None is left as it is."""
        if model_state is not None:
            module.load_state_dict(model_state)
        if optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)

    def sharded_entries(self, state: Mapping) -> tuple:
        """The entries of a checkpoint's ``state`` that each rank holds its own part of (every rank
        writes them, :meth:`save_shards`); the others are rank 0's (trainer entries) or per rank."""
        return ()

    def save_shards(self, state: dict, directory) -> None:
        """Every rank writes its part of ``state`` into ``directory`` (collective)."""
        shards.save_shards(state, directory)

    def read_shards(self, template: dict, directory) -> dict:
        """``template`` (this run's sharded entries) filled from ``directory``, at any world size."""
        return shards.read_shards(template, directory)

    def full_state_dict(self, module: nn.Module) -> dict:
        """The whole model's state dict as plain CPU tensors (copies) on rank 0, empty elsewhere;
        every rank calls it."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``tensor`` (a parameter, its gradient, an optimizer state)."""
        return shards.local(tensor)

    def shard_like(self, part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``part`` (shaped as this rank's part of ``like``) laid out as ``like`` for a checkpoint."""
        return shards.shard_like(part, like)

    def memory(self, module: nn.Module, optimizer=None) -> dict:
        """Bytes this rank holds of parameters, gradients and optimizer state."""
        return shards.local_bytes(module, optimizer)

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}(trainer.strategy={self.name})"
