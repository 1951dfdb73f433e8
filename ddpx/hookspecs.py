"""Every hook a ddpx plugin can implement: the whole training loop, in order.

A plugin is a module or object with functions decorated by ``@ddpx.hookimpl``
whose names and argument names match the specs below (a plugin may accept a
subset of the arguments). Kinds of hook:

* notification hooks return nothing; every plugin's implementation is called;
* provider hooks (``firstresult=True``) stop at the first implementation that
  returns something other than ``None``; the core trainer registers the
  defaults last (``trylast``), so any plugin can take over;
* wrapper hooks (``ddpx_forward``, ``ddpx_micro_step``) surround a step: a
  plugin implements them with ``@hookimpl(wrapper=True)`` as a generator that
  ``yield``\\ s once (inside e.g. ``autocast()`` or ``no_sync()``), receives the
  inner result from the ``yield`` and returns it, possibly changed.

The order of one micro-batch; the optimizer step happens on the last one of
an optimizer step's ``accumulate`` micro-batches (``sync`` true)::

    ddpx_should_step -> ddpx_micro_step [ ddpx_forward -> ddpx_backward ]
    -> if sync: ddpx_optimizer_step -> (zero grads, scheduler step, global_step += 1)
    -> ddpx_batch_end (every micro-batch) -> if sync: calls scheduled with trainer.call_at_step

At an epoch's end: the epoch's loss is all-reduced (a non-finite one stops or
warns, ``trainer.nonfinite``), ``ddpx_evaluate`` runs, then ``ddpx_epoch_end``.

``trainer`` is a :class:`ddpx.trainer.Trainer`; its public attributes
(``config``, ``model``, ``module``, ``optimizer``, ``scheduler``, ``rank``,
``world_size``, ``local_rank``, ``device``, ``epoch``, ``global_step``,
``run_dir``, ``plugin_manager``) are documented there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from .markers import hookspec

if TYPE_CHECKING:  # imported only for the annotations
    import torch
    from torch.utils.data import DataLoader, Dataset

    from .config import Config
    from .trainer import Trainer


# --- configuration and set-up --------------------------------------------------------


@hookspec
def ddpx_config_defaults() -> Mapping[str, Mapping[str, Any]]:
    """Declare this plugin's config section(s) and their defaults.

    Return ``{"section": {"key": default, ...}}``. Only declared keys are valid
    in a config file; the type of each default is the type the key must have
    (``None`` defaults accept any type). Called once, before the config is read.
    """


@hookspec
def ddpx_configure(config: "Config") -> None:
    """The validated config is ready (read your section). Called on every rank
    and in the launcher before anything distributed exists."""


@hookspec
def ddpx_setup(trainer: "Trainer") -> None:
    """The process group is up and the device is bound; nothing is built yet."""


@hookspec(firstresult=True)
def ddpx_build_model(trainer: "Trainer") -> Optional["torch.nn.Module"]:
    """Provide the (unwrapped) model. Default: ``config.model`` import path."""


@hookspec(firstresult=True)
def ddpx_wrap_model(trainer: "Trainer", model: "torch.nn.Module") -> Optional["torch.nn.Module"]:
    """Wrap the model for data parallelism. Default: ``DistributedDataParallel``
    with the ``trainer.find_unused_parameters`` / ``static_graph`` options."""


@hookspec
def ddpx_ddp_options(trainer: "Trainer") -> Optional[Mapping[str, Any]]:
    """Keyword arguments this plugin wants passed to ``DistributedDataParallel``
    by the core's ``ddpx_wrap_model`` (the comm hook plugin: its hook's
    ``bucket_cap_mb``). The config's ``trainer.find_unused_parameters``,
    ``static_graph`` and a non-null ``bucket_cap_mb`` win; two plugins asking
    for different values of a key the config leaves open is an error."""


@hookspec
def ddpx_model_wrapped(trainer: "Trainer", model: "torch.nn.Module") -> None:
    """The wrapped model exists (``trainer.model``): register comm hooks here."""


@hookspec(firstresult=True)
def ddpx_build_dataloaders(
    trainer: "Trainer", train_set: "Dataset", eval_set: Optional["Dataset"]
) -> Optional[tuple["DataLoader", Optional["DataLoader"]]]:
    """Provide ``(train_loader, eval_loader)``. The sampler plugin shards them
    across ranks; the default is unsharded loaders (every rank sees all data)."""


# --- the loop -------------------------------------------------------------------------


@hookspec
def ddpx_train_start(trainer: "Trainer") -> None:
    """Everything is built and restored; the first epoch is about to start."""


@hookspec
def ddpx_epoch_start(trainer: "Trainer", epoch: int) -> None:
    """Epoch ``epoch`` (0-based) starts; its data loader has not been iterated yet."""


@hookspec(firstresult=True)
def ddpx_should_step(trainer: "Trainer", batch_index: int, num_batches: int) -> Optional[bool]:
    """Whether the micro-batch ``batch_index`` (of ``num_batches`` this epoch on
    this rank) ends an optimizer step. Default: every batch steps."""


@hookspec(firstresult=True)
def ddpx_micro_step(trainer: "Trainer", batch: Any, sync: bool) -> "torch.Tensor":
    """Forward and backward of one micro-batch; returns the loss (detached).

    Wrapper hook: surround it to run the micro-batch in a context, e.g.
    ``model.no_sync()`` when ``sync`` is False. The core implements the body.
    """


@hookspec(firstresult=True)
def ddpx_forward(trainer: "Trainer", batch: Any) -> "torch.Tensor":
    """Compute the loss of one micro-batch (the value that is back-propagated).

    Wrapper hook: surround it with ``autocast``, or change the returned loss
    (e.g. scale it by 1/N for accumulation). The core implements the body:
    :func:`ddpx.trainer.model_loss` (tuple or dict batches; the loss function,
    or the model's own loss with ``loss.target: null``).
    """


@hookspec(firstresult=True)
def ddpx_backward(trainer: "Trainer", loss: "torch.Tensor") -> Optional[bool]:
    """Back-propagate ``loss``; return True when done. Default: ``loss.backward()``.
    AMP provides ``scaler.scale(loss).backward()``."""


@hookspec(firstresult=True)
def ddpx_optimizer_step(trainer: "Trainer") -> Optional[bool]:
    """Clip (``trainer.clip_gradients()``) and step the optimizer; return True
    if the step was applied, False if skipped (e.g. fp16 overflow). Default:
    clip and ``optimizer.step()``. Gradients are zeroed by the core afterwards."""


@hookspec
def ddpx_batch_end(
    trainer: "Trainer", batch_index: int, loss: "torch.Tensor", stepped: bool
) -> None:
    """A micro-batch finished; ``stepped`` tells whether the optimizer stepped.

    Runs after every micro-batch: for work every N steps, schedule a call
    with ``trainer.call_at_step`` instead (nothing then runs per step)."""


@hookspec(firstresult=True)
def ddpx_evaluate(trainer: "Trainer", loader: "DataLoader") -> Optional[dict]:
    """Evaluate on ``loader`` and return metrics reduced over all ranks
    (default: ``loss``, and ``accuracy`` for class logits or the metrics of
    ``trainer.eval_metric``)."""


@hookspec
def ddpx_epoch_end(trainer: "Trainer", epoch: int, metrics: dict) -> None:
    """Epoch ``epoch`` finished; ``metrics`` holds the epoch's train and eval metrics."""


@hookspec
def ddpx_train_end(trainer: "Trainer") -> None:
    """Training finished normally (not called after an exception)."""


@hookspec
def ddpx_exception(trainer: "Trainer", exc: BaseException) -> None:
    """Training is aborting because of ``exc`` (also KeyboardInterrupt)."""


# --- checkpoints ------------------------------------------------------------------------


@hookspec
def ddpx_state_dict(trainer: "Trainer") -> Optional[Mapping[str, Any]]:
    """Return ``{"name": state}`` for the parts of the checkpoint this plugin
    owns (sampler position, GradScaler, comm-hook error feedback, ...)."""


@hookspec
def ddpx_load_state_dict(trainer: "Trainer", state: Mapping[str, Any]) -> None:
    """Restore from a checkpoint; ``state`` holds every plugin's entries."""


def all_hook_names() -> Iterable[str]:
    """Names of every hook specified here."""
    return sorted(n for n in globals() if n.startswith("ddpx_"))
