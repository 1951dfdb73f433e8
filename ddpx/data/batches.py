"""Batches as the trainer sees them: moved to the device, their loss, their size.

A batch is ``(inputs, targets, ...)``, a dict (``labels`` are the targets), or whatever a
model that computes its own loss takes (``loss.target: null``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import DdpxError


def to_device(batch: Any, device: torch.device) -> Any:
    """Move tensors in a (nested) tuple/list/dict batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


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
