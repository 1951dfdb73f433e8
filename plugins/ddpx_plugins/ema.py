"""An exponential moving average (EMA) of the weights, evaluated beside the raw ones.

With ``ema.decay`` set (e.g. 0.999) the plugin keeps, on every rank, a copy of
the parameters that starts as the weights after optimizer step ``start_step``
(0: the initial weights) and then, every ``every_steps`` optimizer steps, moves
toward them: ``ema += (1 - decay) * (weights - ema)``, one fused
``torch._foreach_lerp_`` over all tensors. The update is a call scheduled with
``trainer.call_at_step``, so it runs after the optimizer step, and the steps
between updates cost nothing. The weights are the same on every rank (DDP), so
is the EMA: nothing is communicated. Under ``trainer.strategy: fsdp`` each rank
averages its own shards of the parameters (``DTensor.to_local()``: the EMA takes
1/world of the model's memory, as the weights do), still without communication.
``buffers: true`` averages the floating
buffers too (BatchNorm's running statistics) and copies the others; otherwise
the EMA is evaluated with the model's own buffers.

Evaluation (``eval: true``): at every epoch end that evaluated, the EMA weights
are copied into the model, evaluated with the same ``trainer.evaluate()``, and
the raw weights copied back; each metric is added as ``ema_<name>``
(``ema_accuracy``, ``ema_eval_loss``), so every logger and the checkpoint
monitor see it.

Checkpoints: the key ``ema`` holds the averaged tensors, the number of updates
and the step of the last one. Rank 0's checkpoint entry alone carries them (the
EMA is identical everywhere; a checkpoint does not hold one copy per rank) and
a resume broadcasts it from rank 0, so a resume at the same or another world
size continues the same average. Under fsdp the entry holds each rank's shards as
DTensors shaped like the parameters, so the checkpoint plugin writes it into the step's
shard directory beside the model (``torch.distributed.checkpoint``, each rank its part)
and a resume at any world size reads it back into that run's sharding; no rank ever
holds the whole average. At the end of training rank 0 writes
``run_dir/<export>`` (``ema_weights.pt``): ``{"weights": "ema", "decay",
"step", "updates", "state_dict"}``, the module's state dict with the EMA's
parameters (and buffers with ``buffers: true``), loadable with
``model.load_state_dict(torch.load(path)["state_dict"])``; under fsdp the EMA shards are
swapped into the model and gathered like the trained model in ``run_dir/model/`` (every rank takes part).

Per-run state: ``trainer.plugin("ema").state`` (an :class:`EmaState`, None when off;
docs/plugins.md, "Per-run state").
"""

from __future__ import annotations

import os

from ddpx import hookimpl
from ddpx.errors import DdpxError
from ddpx.plugin.shared import EMA_WEIGHTS_FILE

EXPORT = "ema_weights.pt"


class EmaState:
    """One run's average: ``params`` (and ``buffers``) as detached tensors beside the model's:
    this rank's parts of them (plain tensors; the strategy's ``local``). ``replicated``: the
    strategy's, every rank holds the same whole average (else each rank its part, fsdp's shards)."""

    def __init__(self, module, strategy, decay, every_steps, start_step, with_buffers):
        import torch

        self.decay, self.every_steps, self.start_step = decay, every_steps, start_step
        self.strategy = strategy
        self.replicated = strategy.replicated
        self.names = [name for name, _ in module.named_parameters()]
        self.live_params = [p for _, p in module.named_parameters()]  # DTensors under fsdp
        with torch.no_grad():
            self.params = [t.detach().clone() for t in self.live()]
        buffers = list(module.named_buffers()) if with_buffers else []
        self.buffer_names = [name for name, _ in buffers]
        self.live_buffers = [b for _, b in buffers]
        self.buffers = [b.detach().clone() for b in self.live_buffers]
        self.updates = 0  # lerps since the copy at start_step
        self.step = None  # the optimizer step of the last update (or of the copy); None: not started
        self.export_path = None  # where train_end wrote the EMA weights (rank 0)

    def live(self):
        """The model's parameters as plain tensors: this rank's parts (looked up at each use: FSDP
        may replace a shard's local tensor, e.g. when a state dict is loaded). Call under no_grad."""
        return [self.strategy.local(p) for p in self.live_params]

    def update(self, step):
        """Fold the weights after optimizer step ``step`` into the average (the first call copies)."""
        import torch

        with torch.no_grad():
            live = self.live()
            floating = [(e, b) for e, b in zip(self.buffers, self.live_buffers) if e.is_floating_point()]
            if self.step is None:
                torch._foreach_copy_(self.params, live)
                if self.buffers:
                    torch._foreach_copy_(self.buffers, self.live_buffers)
            else:
                weight = 1.0 - self.decay
                torch._foreach_lerp_(self.params, live, weight)
                if floating:
                    torch._foreach_lerp_([e for e, _ in floating], [b for _, b in floating], weight)
                others = [(e, b) for e, b in zip(self.buffers, self.live_buffers) if not e.is_floating_point()]
                if others:
                    torch._foreach_copy_([e for e, _ in others], [b for _, b in others])
                self.updates += 1
        self.step = step

    def next_step(self, step):
        """The optimizer step of the first update after ``step``."""
        if step < self.start_step:
            return self.start_step
        return step + self.every_steps - (step - self.start_step) % self.every_steps

    def swapped_in(self):
        """A context: the model holds the EMA weights (and buffers) inside, its own after (under
        fsdp each rank swaps its shards: the next forward gathers the EMA's)."""
        import contextlib

        import torch

        @contextlib.contextmanager
        def swap():
            with torch.no_grad():
                live = self.live() + self.live_buffers
                saved = [t.detach().clone() for t in live]
                torch._foreach_copy_(live, self.params + self.buffers)
            try:
                yield
            finally:
                with torch.no_grad():
                    torch._foreach_copy_(self.live() + self.live_buffers, saved)

        return swap()

    def state_dict(self):
        if not self.replicated:  # each rank's parts as DTensors: the checkpoint plugin writes them with the model's
            return {"params": dict(zip(self.names, self.shards())), "buffers": dict(zip(self.buffer_names, self.buffers)),
                    "decay": self.decay, "updates": self.updates, "step": self.step}
        return {"names": self.names, "params": [p.cpu() for p in self.params], "buffer_names": self.buffer_names,
                "buffers": [b.cpu() for b in self.buffers], "decay": self.decay, "updates": self.updates,
                "step": self.step}

    def shards(self):
        """The EMA's parts laid out as the parameters (views: a load into them fills ``params``)."""
        import torch

        with torch.no_grad():
            return [self.strategy.shard_like(e, p) for e, p in zip(self.params, self.live_params)]

    def load(self, saved):
        import torch

        params, buffers = saved["params"], saved["buffers"]
        if isinstance(params, dict):  # each rank's part: read from the shard directory into this run's layout
            names, buffer_names = list(params), list(buffers)
            params, buffers = [self.strategy.local(params[n]) for n in self.names if n in params], list(buffers.values())
        else:
            names, buffer_names = saved["names"], saved["buffer_names"]
        if names != self.names or buffer_names != self.buffer_names:
            raise DdpxError("the checkpoint's ema entry holds other tensors than this model has (changed model or "
                            "ema.buffers); set checkpoint.resume=false or use the config it was written with")
        with torch.no_grad():
            torch._foreach_copy_(self.params, [p.to(e.device) for p, e in zip(params, self.params)])
            if self.buffers:
                torch._foreach_copy_(self.buffers, [b.to(e.device) for b, e in zip(buffers, self.buffers)])
        self.updates, self.step = saved["updates"], saved["step"]

    def module_state_dict(self, module):
        """``module.state_dict()`` with the EMA's tensors in place of the live ones, as the strategy
        gives the whole model (rank 0; gathered under fsdp, empty elsewhere): every rank calls it."""
        with self.swapped_in():
            return self.strategy.full_state_dict(module)


def _schedule(trainer, ema):
    def at_step(trainer):
        ema.update(trainer.global_step)
        trainer.call_at_step(ema.next_step(trainer.global_step), at_step)

    trainer.call_at_step(ema.next_step(trainer.global_step), at_step)


class EmaPlugin:
    """``state``: the run's :class:`EmaState`, or None without ``ema.decay``."""

    def __init__(self):
        self.state = None

    @hookimpl
    def ddpx_config_defaults(self):
        return {"ema": {"decay": None, "every_steps": 1, "start_step": 0, "eval": True, "buffers": False}}

    @hookimpl
    def ddpx_configure(self, config):
        cfg = config.section("ema")
        decay = cfg["decay"]
        if decay is not None and (isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1):
            raise DdpxError(f"ema.decay must be a number between 0 and 1 (e.g. 0.999), or null for no EMA (got {decay!r})")
        if cfg["every_steps"] < 1:
            raise DdpxError(f"ema.every_steps must be >= 1 (got {cfg['every_steps']})")
        if cfg["start_step"] < 0:
            raise DdpxError(f"ema.start_step must be >= 0 (got {cfg['start_step']})")

    @hookimpl
    def ddpx_setup(self, trainer):
        self.state = None  # made with the model (ddpx_model_wrapped)

    @hookimpl
    def ddpx_model_wrapped(self, trainer, model):
        cfg = trainer.config.section("ema")
        if cfg["decay"] is not None:
            self.state = EmaState(trainer.module, trainer.strategy, float(cfg["decay"]), cfg["every_steps"],
                                  cfg["start_step"], cfg["buffers"])

    @hookimpl(trylast=True)  # after the checkpoint plugin restored the average and global_step
    def ddpx_train_start(self, trainer):
        ema = self.state
        if ema is None:
            return
        if ema.step is None and trainer.global_step >= ema.start_step:  # start_step 0: from the initial weights
            if trainer.global_step > 0:
                trainer.log.warning(f"ema: resumed at step {trainer.global_step} from a checkpoint without an EMA: "
                                    "the average starts from the resumed weights")
            ema.update(trainer.global_step)
        _schedule(trainer, ema)

    @hookimpl(tryfirst=True)  # before the logging and checkpoint plugins see the metrics
    def ddpx_epoch_end(self, trainer, epoch, metrics):
        ema = self.state
        if ema is None or not trainer.config.section("ema")["eval"] or ema.step is None:
            return
        if trainer.eval_loader is None or "eval_loss" not in metrics:
            return  # this epoch did not evaluate (trainer.eval_every_epochs)
        with ema.swapped_in():
            results = trainer.evaluate()
        for key, value in results.items():
            metrics["ema_" + ("eval_loss" if key == "loss" else key)] = value  # named as the raw metrics are

    def state_dict(self, trainer):
        ema = self.state
        if ema is None:
            return None
        # Replicated, identical on every rank: rank 0's entry carries it (the others hold a marker).
        # Otherwise every rank its part.
        return ema.state_dict() if trainer.rank == 0 or not ema.replicated else {"on_rank": 0}

    def load_state_dict(self, trainer, saved):
        ema = self.state
        if ema is None:
            return
        import torch
        import torch.distributed as dist

        from ddpx.train.stopping import across_ranks

        if across_ranks(trainer) and ema.replicated:  # else every rank read its part from the shard directory
            # rank 0 reads ranks[0] of the checkpoint at any world size: its copy is the one.
            present = torch.tensor([1 if saved is not None else 0], device=trainer.device)
            dist.broadcast(present, src=0)
            if not int(present.item()):
                return
            if trainer.rank == 0:
                ema.load(saved)
            meta = [ema.updates, ema.step] if trainer.rank == 0 else [None, None]
            dist.broadcast_object_list(meta, src=0)
            for tensor in ema.params + ema.buffers:
                dist.broadcast(tensor, src=0)
            ema.updates, ema.step = meta
        elif saved is not None:
            ema.load(saved)

    @hookimpl
    def ddpx_train_end(self, trainer):
        ema = self.state
        if ema is None or ema.step is None:
            return
        import torch

        from ddpx.rank.checkpoint_files import atomic_write

        state_dict = ema.module_state_dict(trainer.module)  # every rank: fsdp gathers
        if trainer.rank != 0:
            return
        path = os.path.join(str(trainer.run_dir), EXPORT)
        export = {"weights": "ema", "decay": ema.decay, "step": ema.step, "updates": ema.updates,
                  "state_dict": state_dict}
        atomic_write(path, lambda f: torch.save(export, f))
        ema.export_path = trainer.shared[EMA_WEIGHTS_FILE] = path
        trainer.log.info(f"wrote the EMA weights (decay {ema.decay}, {ema.updates} updates to step {ema.step}) to "
                         f"{path}; the final checkpoint holds the raw weights")
