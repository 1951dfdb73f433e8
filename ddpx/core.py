"""The core plugin: the default bodies of the provider and wrapper hooks.

:class:`CorePlugin` is registered ``trylast`` under the name "core" by the
plugin manager (which loads it by its import path), so any plugin can take
over a hook. Beside it, the helpers those bodies share with the trainer and
the benchmarks: :func:`to_device`, :func:`model_loss`, :func:`batch_size` and
:func:`ddp_options` (the DistributedDataParallel keyword arguments).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from .config import Config
from .errors import DdpxError
from .imports import instantiate, resolve
from .markers import hookimpl

if TYPE_CHECKING:  # imported only for the annotations
    from .trainer import Trainer


def to_device(batch: Any, device: torch.device) -> Any:
    """Move tensors in a (nested) tuple/list/dict batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


# A GradScaler's scale this low means every step overflows: divergence, not an overflow now and then.
MIN_LOSS_SCALE = 2.0 ** -16
LABELS = "labels"  # the targets' key in a dict batch when the config names a loss


def model_loss(model, loss_fn, batch) -> tuple:
    """``(loss, outputs, targets)`` of one batch.

    With a loss function (``loss.target``): a sequence batch is ``(inputs,
    targets, ...)`` and the loss ``loss_fn(model(inputs), targets)`` (inputs may
    be nested); a dict batch passes every entry but ``labels`` to the model as
    keyword arguments, and ``labels`` are the targets. Without one
    (``loss.target: null``) the model computes its own loss, as Hugging Face
    models do: it is called as ``model(**batch)`` (dict), ``model(*batch)``
    (sequence) or ``model(batch)``, and returns the loss or an output with a
    ``loss`` (attribute or key); targets are then None.
    """
    # Sequences first: the Mapping check is an ABC check, slower than list/tuple's.
    if loss_fn is not None:
        if isinstance(batch, (list, tuple)) or not isinstance(batch, Mapping):
            targets = batch[1]
            outputs = model(batch[0])
        else:
            if LABELS not in batch:
                raise DdpxError(f"a dict batch needs a '{LABELS}' entry (the targets of loss.target); it has "
                                f"{', '.join(map(str, batch))}; or set loss.target=null for a model that computes its loss")
            targets = batch[LABELS]
            outputs = model(**{k: v for k, v in batch.items() if k != LABELS})
        return loss_fn(outputs, targets), outputs, targets
    if isinstance(batch, (list, tuple)):
        outputs = model(*batch)
    elif isinstance(batch, Mapping):
        outputs = model(**batch)
    else:
        outputs = model(batch)
    if isinstance(outputs, torch.Tensor):
        return outputs, outputs, None
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise DdpxError(f"loss.target is null, so the model must return its loss (a tensor, or an output with a "
                        f"'loss'), but it returned {type(outputs).__name__}; set loss.target to a loss function")
    return loss, outputs, None


def batch_size(batch, targets=None) -> int:
    """Samples in a batch: the targets' first dimension, else the first tensor's."""
    if isinstance(targets, torch.Tensor):
        return targets.shape[0]
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = batch_size(item)
        if n:
            return n
    return 0


class GradientNorms:
    """The total gradient norm of an optimizer step, and the first parameter whose
    gradient went non-finite (for the non-finite guard's message).

    :meth:`compute` takes one ``_foreach_norm`` per (device, dtype) group, as
    ``clip_grad_norm_`` does, and keeps the per-parameter norms: the earliest
    (step, parameter) with a non-finite norm is folded into one device integer,
    ``step * P + index``, so tracking it costs a few tiny kernels and no host
    sync; :meth:`first_nonfinite` reads it once, when the guard fires."""

    NONE = torch.iinfo(torch.int64).max

    def __init__(self, module: torch.nn.Module):
        self.named = list(module.named_parameters())
        self.first = None  # device int64: step * len(named) + index, or NONE
        self.positions: dict = {}  # tuple of parameter indices -> their device tensor (cached)

    def compute(self, step: int, track: bool = True) -> torch.Tensor:
        """The total 2-norm of the gradients now (a 0-dim device tensor; gradients
        of several dtypes are summed in fp32) at optimizer step ``step``."""
        groups: dict = {}
        for index, (_, p) in enumerate(self.named):
            if p.grad is not None:
                groups.setdefault((p.grad.device, p.grad.dtype), []).append((index, p.grad))
        if not groups:
            return torch.zeros(())
        device = next(iter(groups))[0]
        order = tuple(i for group in groups.values() for i, _ in group)
        norms = torch.cat([torch.stack(torch._foreach_norm([g for _, g in group])).to(device, torch.float32)
                           for group in groups.values()])
        total = torch.linalg.vector_norm(norms)
        if track:
            positions = self.positions.get(order)
            if positions is None:
                positions = self.positions[order] = torch.tensor(order, dtype=torch.int64, device=device)
            keys = torch.where(norms.isfinite(), self.NONE, positions + step * len(self.named))
            self.first = keys.min() if self.first is None else torch.minimum(self.first, keys.min())
        return total

    def first_nonfinite(self) -> Optional[tuple]:
        """``(parameter name, optimizer step)`` of the first non-finite gradient seen, or None."""
        if self.first is None:
            return None
        key = int(self.first.item())
        if key == self.NONE:
            return None
        step, index = divmod(key, len(self.named))
        return self.named[index][0], step


def ddp_options(config: Config, requests) -> dict:
    """``DistributedDataParallel`` keyword arguments: what plugins ask for
    (``ddpx_ddp_options`` results) where the config leaves it open, then the
    config's ``trainer.find_unused_parameters``, ``static_graph`` and a
    non-null ``bucket_cap_mb`` and ``gradient_as_bucket_view``."""
    cfg = config.trainer
    configured = {"find_unused_parameters": cfg.find_unused_parameters, "static_graph": cfg.static_graph}
    for key in ("bucket_cap_mb", "gradient_as_bucket_view"):
        if cfg[key] is not None:
            configured[key] = cfg[key]
    asked: dict = {}
    for options in requests:
        for key, value in (options or {}).items():
            if key in configured:
                continue
            if asked.get(key, value) != value:
                raise DdpxError(f"plugins ask for different DistributedDataParallel {key}: {asked[key]!r} and "
                                f"{value!r}; set trainer.{key} in the config")
            asked[key] = value
    return {**asked, **configured}


class CorePlugin:
    """Default bodies of the provider and wrapper hooks (registered ``trylast`` as "core")."""

    @hookimpl(trylast=True)
    def ddpx_build_model(self, trainer: "Trainer"):
        return instantiate(trainer.config.model, "model")

    @hookimpl(trylast=True)
    def ddpx_wrap_model(self, trainer: "Trainer", model: torch.nn.Module):
        device_ids = [trainer.device] if trainer.device.type == "cuda" else None
        options = ddp_options(trainer.config, trainer.hook.ddpx_ddp_options(trainer=trainer))
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **options)

    @hookimpl(trylast=True)
    def ddpx_build_dataloaders(self, trainer: "Trainer", train_set, eval_set):
        # Unsharded: every rank sees all data, in the same seeded order (the
        # sampler plugin shards it).
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
        return model_loss(trainer.model, trainer.loss_fn, batch)[0]

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
        model = trainer.module
        name = trainer.config.trainer.eval_metric
        metric = resolve(name, "trainer.eval_metric") if name else None
        was_training = model.training
        model.eval()
        # (loss * n, correct, n, batches with class labels)
        sums = torch.zeros(4, dtype=torch.float64, device=trainer.device)
        metric_sums: dict = {}
        with torch.no_grad():
            for batch in loader:
                batch = to_device(batch, trainer.device)
                loss, outputs, targets = model_loss(model, trainer.loss_fn, batch)
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
        model.train(was_training)
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
