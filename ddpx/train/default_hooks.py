"""The default bodies of the provider and wrapper hooks: the plugin named "trainer".

:class:`DefaultHooks` is registered ``trylast`` under the name "trainer" by the plugin
manager (which loads it by its import path), so any plugin can take over a hook. Its
``ddpx_wrap_model`` is the run's strategy's wrap (``DistributedDataParallel`` under ``ddp``,
FSDP2's shards under ``fsdp``: ddpx/strategies/).

Torch is imported inside the hooks that use it, so that loading the plugins (``ddpx plugins``,
the launcher's config check) does not; the step's ``ddpx_forward`` is the trainer's
:meth:`~ddpx.train.trainer.Trainer.batch_loss`, which imports nothing per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..imports import instantiate, resolve
from ..plugin.markers import hookimpl

if TYPE_CHECKING:  # imported only for the annotations
    import torch
    from torch.utils.data import DataLoader

    from .trainer import Trainer


# A GradScaler's scale this low means every step overflows: divergence, not an overflow now and then.
MIN_LOSS_SCALE = 2.0 ** -16


class DefaultHooks:
    """Default bodies of the provider and wrapper hooks (registered ``trylast`` as "trainer")."""

    @hookimpl(trylast=True)
    def ddpx_build_model(self, trainer: "Trainer"):
        return instantiate(trainer.config.model, "model")

    @hookimpl(trylast=True)
    def ddpx_wrap_model(self, trainer: "Trainer", model: torch.nn.Module):
        return trainer.strategy.wrap(trainer, model)

    @hookimpl(trylast=True)
    def ddpx_build_dataloaders(self, trainer: "Trainer", train_set, eval_set):
        # Unsharded: every rank sees all data, in the same seeded order (the
        # sampler plugin shards it).
        import torch
        from torch.utils.data import DataLoader

        cfg = trainer.config.trainer
        common = {"num_workers": cfg.num_workers, "pin_memory": trainer.device.type == "cuda"}
        generator = torch.Generator().manual_seed(trainer.config.seed)
        train = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, generator=generator, **common)
        evaluation = None
        if eval_set is not None:
            evaluation = DataLoader(eval_set, batch_size=cfg.eval_batch_size, shuffle=False, **common)
        return train, evaluation

    @hookimpl(trylast=True)
    def ddpx_forward(self, trainer: "Trainer", batch):
        return trainer.batch_loss(batch)

    @hookimpl(trylast=True)
    def ddpx_optimizer_step(self, trainer: "Trainer"):
        scaler, optimizer = trainer.scaler, trainer.optimizer
        if not scaler.is_enabled():  # no fp16 AMP: nothing to unscale, no step skipped
            trainer.clip_gradients()
            optimizer.step()
            return True
        scaler.unscale_(optimizer)  # clipping sees the true gradients
        trainer.clip_gradients()
        scale = scaler.get_scale()
        scaler.step(optimizer)  # skipped inside when a gradient is inf/NaN
        scaler.update()
        new_scale = scaler.get_scale()
        applied = new_scale >= scale  # update() lowers the scale only after an overflow
        if not applied and new_scale < MIN_LOSS_SCALE:  # every step overflows (the same on every rank)
            trainer.nonfinite_loss(f"by optimizer step {trainer.global_step + 1} (epoch {trainer.epoch}): every fp16 "
                                   f"step overflowed until the loss scale fell to {new_scale:g}")
        return applied

    @hookimpl(trylast=True)
    def ddpx_evaluate(self, trainer: "Trainer", loader: DataLoader):
        # Sums (loss * n, correct, n, ...) are all-reduced, so sharded evaluation
        # without padding gives exact metrics. Assumes a mean-reducing loss.
        # Accuracy is built in for class logits and labels; trainer.eval_metric
        # replaces it with the user's metrics (batch means, weighted by n).
        import torch
        import torch.distributed as dist

        from ..data.batches import batch_size, to_device

        model = trainer.module
        name = trainer.config.trainer.eval_metric
        metric = resolve(name, "trainer.eval_metric") if name else None
        was_training = model.training
        model.eval()
        # (loss * n, correct, n, batches with class labels)
        sums = torch.zeros(4, dtype=torch.float64, device=trainer.device)
        metric_sums: dict = {}
        with trainer.strategy.evaluating(trainer, loader) as padding, torch.no_grad():
            for batch in loader:
                batch = to_device(batch, trainer.device)
                loss, outputs, targets = trainer.strategy.eval_loss(trainer, model, batch)
                n = batch_size(batch, targets)
                sums[0] += loss.double() * n
                sums[2] += n
                if metric is not None:
                    for key, value in metric(outputs, batch).items():
                        metric_sums[key] = metric_sums.get(key, 0.0) + torch.as_tensor(value, dtype=torch.float64,
                                                                                       device=trainer.device) * n
                elif (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.dim() == 2
                      and targets.dim() == 1 and not targets.is_floating_point()):
                    sums[3] += 1
                    sums[1] += (outputs.argmax(dim=1) == targets).sum()
            for _ in range(padding):  # forwards whose results are not counted: see Strategy.evaluating
                trainer.strategy.eval_loss(trainer, model, batch)
        model.train(was_training)
        if not trainer.strategy.counts_loss(trainer):  # another rank of this replica counts its batches
            sums.zero_()
            metric_sums = {key: value * 0 for key, value in metric_sums.items()}
        if metric is not None:
            # A rank may have had no batch to learn the names from: agree on them first.
            names: list = [None] * trainer.world_size
            dist.all_gather_object(names, sorted(metric_sums))
            keys = sorted(set().union(*names))
            sums = torch.cat([sums, torch.stack([metric_sums.get(k, sums.new_zeros(())) for k in keys])]) if keys else sums
        dist.all_reduce(sums)
        loss_sum, correct, count, classified = sums[:4].tolist()
        if count == 0:
            return {}
        metrics = {"loss": loss_sum / count}
        if classified:
            metrics["accuracy"] = correct / count
        if metric is not None:
            metrics.update({key: value / count for key, value in zip(keys, sums[4:].tolist())})
        return metrics
