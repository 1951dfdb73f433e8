"""Every hook a ddpx plugin can implement: the whole training loop, in order.

A plugin is a module or object with functions decorated by ``@ddpx.hookimpl``
whose names and argument names match the specs below (a plugin may accept a
subset of the arguments). Kinds of hook:

* notification hooks return nothing; every plugin's implementation is called;
* provider hooks (``firstresult=True``) stop at the first implementation that
  returns something other than ``None``; the trainer registers the
  defaults last (``trylast``), so any plugin can take over;
* a provider hook may also be implemented as a wrapper, with
  ``@hookimpl(wrapper=True)`` as a generator that ``yield``\\ s once, receives
  the inner result from the ``yield`` and returns it, possibly changed (e.g.
  around ``ddpx_forward``).

The order of the hooks is :data:`HOOK_ORDER` (:data:`START_HOOKS`,
:data:`STEP_HOOKS`, :data:`EPOCH_END_HOOKS`, :data:`END_HOOKS`); the trainer attributes and
methods a plugin may use are :data:`TRAINER_ATTRIBUTES` and
:data:`TRAINER_METHODS`. This module is their one source: the
:class:`ddpx.train.trainer.Trainer` docstring and the hook reference
``docs/plugin_hooks.md`` are made from it (``python docs/make_plugin_hooks_md.py``;
``tests/test_docs.py`` fails when the file is stale).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Mapping, Optional

from .markers import hookspec

if TYPE_CHECKING:  # imported only for the annotations
    import torch
    from torch.utils.data import DataLoader, Dataset

    from ..config import Config
    from ..train.trainer import Trainer


# The hooks of a run in the order the trainer calls them (tests/test_plugin_system.py reads these).
START_HOOKS = ("ddpx_setup", "ddpx_build_model", "ddpx_wrap_model", "ddpx_model_wrapped",
               "ddpx_build_dataloaders", "ddpx_autocast", "ddpx_grad_scaler", "ddpx_train_start")
# One optimizer step; the MICRO_BATCH_HOOKS among them run once per micro-batch of the window.
STEP_HOOKS = ("ddpx_step_window", "ddpx_forward", "ddpx_optimizer_step", "ddpx_batch_end")
MICRO_BATCH_HOOKS = ("ddpx_forward", "ddpx_batch_end")
EPOCH_END_HOOKS = ("ddpx_evaluate", "ddpx_epoch_end")
END_HOOKS = ("ddpx_train_end",)

HOOK_ORDER = f"""\
At start-up (every rank): ddpx_configure (also in the launcher), then
{" -> ".join(START_HOOKS)}
(ddpx_wrap_model's default is the strategy's wrap; a checkpoint is restored in ddpx_train_start).

Every epoch: ddpx_epoch_start, then for every optimizer step (Trainer.train_step):

    ddpx_step_window (how many micro-batches)
    -> for each micro-batch: ddpx_forward under the autocast context, backward
       (all but the last micro-batch in the strategy's no_sync context, e.g. DDP's no_sync or
       FSDP's set_requires_gradient_sync(False): gradients are reduced once per step)
    -> ddpx_optimizer_step (clip, step) -> zero grads, scheduler step, global_step += 1
    -> ddpx_batch_end for each micro-batch (`stepped` is true for the last one when the step was applied)
    -> the calls scheduled with trainer.call_at_step

At the epoch's end the epoch's loss is all-reduced (a non-finite one stops or
warns, `trainer.nonfinite`), then {" -> ".join(EPOCH_END_HOOKS)}.

At the end: {" -> ".join(END_HOOKS)} (training finished normally) or ddpx_exception
(training is aborting); ddpx_state_dict / ddpx_load_state_dict whenever a
checkpoint is saved or restored."""

TRAINER_ATTRIBUTES = {
    "config": "the validated :class:`~ddpx.config.Config`",
    "plugin_manager": "the pluggy plugin manager of the run",
    "hook": "``plugin_manager.calls``, to call a hook (``trainer.hook.ddpx_evaluate(...)``, arguments by keyword)",
    "rank": "this process's global rank",
    "world_size": "the number of ranks",
    "local_rank": "the rank on this node",
    "device": "the ``torch.device`` this rank trains on",
    "backend": "the process group backend (``gloo``, ``nccl``, ...)",
    "model": "the model as the strategy wraps it (DistributedDataParallel under ``ddp``, the FSDP2 module under "
             "``fsdp``; compiled with ``trainer.compile``)",
    "module": "the unwrapped model",
    "strategy": "the run's :class:`~ddpx.strategies.Strategy` (``trainer.strategy``): what the parallelism means "
                "for wrapping, accumulation, state, gradient norms and evaluation; ask it instead of its name",
    "optimizer": "the optimizer",
    "scheduler": "the LR scheduler, or None",
    "loss_fn": "the loss function (``loss.target``), or None when the model computes its loss",
    "train_set": "the training data set",
    "eval_set": "the evaluation data set, or None",
    "train_loader": "the training data loader",
    "eval_loader": "the evaluation data loader, or None",
    "epoch": "the epoch running or about to run (0-based)",
    "global_step": "optimizer-step boundaries so far",
    "batch_index": "the micro-batch in the epoch (the one training, or the last trained)",
    "num_batches": "micro-batches of the running epoch on this rank (``len(train_loader)`` at its start; for "
                   "a loader without ``__len__``, ``sys.maxsize`` until the ranks agree its data ended, then "
                   "the batches this rank trained)",
    "epoch_batches": "micro-batches of the running epoch trained so far by this run",
    "epoch_finished": "whether every batch of the running epoch was trained",
    "run_dir": "the run directory (``pathlib.Path``; exists on every rank)",
    "last_loss": "the detached loss tensor of the last micro-batch",
    "metrics": "one dict of metrics per finished epoch",
    "is_main": "rank 0",
    "log": "the rank-aware ``ddpx`` logger",
    "stop_requested": "set by :meth:`request_stop`: the loop stops at the next batch boundary",
    "stop_agreement": "the run's :class:`~ddpx.train.stopping.StopAgreement` once a plugin turned it on, else None",
    "epoch_losses": "the running epoch's micro-batch losses (:class:`ddpx.train.losses.EpochLosses`)",
    "next_due_step": "the step of the next call scheduled with ``call_at_step``",
    "end_reason": "why training ends early, set through :meth:`end_training`",
    "peer_failure": "set (before ``ddpx_exception``) when the run failed because another rank did, e.g. "
                    "``stopped at step 46: rank 1 failed first: ...``; else None",
    "failure_store": "set (before ``ddpx_exception``) after a failure: the store the failing ranks agree through "
                     "on who reports it, kept after the process group is gone; else None",
    "shared": "what the run's plugins share, typed: ``shared[KEY]``, ``shared.get(KEY)`` "
              "(:mod:`ddpx.plugin.shared`: the keys, who sets and who reads them)",
    "autocast": "the context every forward pass runs in (``ddpx_autocast``; a null context without AMP)",
    "scaler": "the ``torch.amp.GradScaler`` (``ddpx_grad_scaler``; a disabled one without fp16 AMP)",
    "skipped_steps": "optimizer steps not applied (the scaler skipped them: gradients overflowed); the same "
                     "on every rank, checked at epoch boundaries with ``trainer.check_collectives``",
    "grad_norm": "the total gradient norm (0-dim device tensor) of the latest step that computed it, or None",
    "grad_norm_step": "the optimizer step ``grad_norm`` belongs to",
}

TRAINER_METHODS = {
    "train_step(batches)": "one optimizer step over a window of micro-batches; returns (losses, applied)",
    "forward_backward(batch, window)": "forward and backward of one micro-batch, the loss divided by ``window``",
    "batch_loss(batch)": "the loss of one micro-batch as the default ``ddpx_forward`` computes it "
                         "(``loss.target``, or the model's own loss)",
    "backward(loss)": "back-propagate ``loss`` through the scaler",
    "clip_gradients()": "clip the gradient norm to ``trainer.grad_clip``; returns the norm",
    "watch_grad_norm(step)": "compute ``grad_norm`` at optimizer step ``step`` also without ``grad_clip``",
    "evaluate(loader=None)": "metrics on ``loader`` (default: the eval loader), reduced over all ranks",
    "state_dict()": "the trainer's state, each plugin object's ``state_dict()`` under its name, ``ddpx_state_dict`` entries",
    "load_state_dict(state)": "restore what ``state_dict()`` holds",
    "plugin(name)": "the registered plugin ``name`` (a built-in plugin's object holds its per-run state); "
                    "a one-line error when it is not loaded",
    "has_plugin(name)": "whether plugin ``name`` is loaded",
    "request_stop(signum)": "stop at the next batch boundary (every rank at the same step)",
    "end_training(reason)": "finish normally after the running epoch (every rank in the same epoch)",
    "nonfinite_loss(where)": "act on ``trainer.nonfinite`` for a non-finite loss (every rank alike)",
    "nonfinite_weights(where)": "act on ``trainer.nonfinite`` for non-finite weights (every rank alike)",
    "call_at_step(step, callback)": "call ``callback(trainer)`` once at the first step boundary >= ``step``",
    "open_loss_window()": "a window over the micro-batch losses from now on (``take()``, ``pending``)",
    "run_due_calls()": "run the calls scheduled for ``global_step`` (the loop does, at step boundaries)",
    "agree_on_stops(every_steps, every_s, timeout_s, timeout_key, what)":
        "stop every rank after the same step on SIGTERM/SIGINT/SIGHUP (see ``ddpx.train.stopping``)",
}

# The lifecycle a driver (``ddpx train``, the smoke run, the benchmarks) calls, in this order.
TRAINER_LIFECYCLE = {
    "setup()": "take the signals, join the process group, build through the hooks, ``ddpx_train_start``",
    "train(until_step=None)": "train to the end, or pause at the first step boundary >= ``until_step``",
    "finish()": "training ended normally: ``ddpx_train_end`` (the final checkpoint)",
    "close(exc=None)": "on every exit path: name the plugin that raised ``exc`` and call ``ddpx_exception``, "
                       "then restore the signals, free the model before the process group, detach per-run plugins",
    "run()": "``setup``, ``train``, ``finish``, and ``close`` on every exit path: what ``ddpx train`` runs",
}


def trainer_attribute_text() -> str:
    """The attributes and methods as reST lines (the Trainer's docstring)."""
    lines = [f"``{name}``: {text}" for name, text in TRAINER_ATTRIBUTES.items()]
    lines += [f":meth:`{name.partition('(')[0]}`: {text}" for name, text in TRAINER_METHODS.items()]
    lines += [f":meth:`{name.partition('(')[0]}` (lifecycle): {text}" for name, text in TRAINER_LIFECYCLE.items()]
    return "\n".join(f"* {line}" for line in lines)


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
    """Wrap the model for the run's parallelism. Default: ``trainer.strategy.wrap`` (under ``ddp``
    ``DistributedDataParallel`` with the ``trainer.find_unused_parameters`` / ``static_graph``
    options, under ``fsdp`` FSDP2's ``fully_shard``: :mod:`ddpx.strategies`)."""


@hookspec
def ddpx_model_wrapped(trainer: "Trainer", model: "torch.nn.Module") -> None:
    """The wrapped model exists (``trainer.model``); the comm_hook plugin installs its compression here."""


@hookspec(firstresult=True)
def ddpx_build_dataloaders(
    trainer: "Trainer", train_set: "Dataset", eval_set: Optional["Dataset"]
) -> Optional[tuple["DataLoader", Optional["DataLoader"]]]:
    """Provide ``(train_loader, eval_loader)``. The sampler plugin shards them
    across ranks; the default is unsharded loaders (every rank sees all data)."""


@hookspec(firstresult=True)
def ddpx_autocast(trainer: "Trainer") -> Optional[ContextManager]:
    """The context every forward pass (model and loss) runs in, e.g. ``torch.autocast(...)``
    (the AMP plugin). Asked once, before ``ddpx_train_start``; entered once per
    micro-batch, so it must be reusable. Default: none."""


@hookspec(firstresult=True)
def ddpx_grad_scaler(trainer: "Trainer") -> Optional["torch.amp.GradScaler"]:
    """A ``torch.amp.GradScaler`` for the run (fp16 AMP), or None. The trainer back-propagates
    ``scaler.scale(loss)``, unscales before clipping and skips an optimizer step whose
    gradients overflowed (``trainer.skipped_steps``). Asked once, before ``ddpx_train_start``."""


# --- the loop -------------------------------------------------------------------------


@hookspec
def ddpx_train_start(trainer: "Trainer") -> None:
    """Everything is built and restored; the first epoch is about to start."""


@hookspec
def ddpx_epoch_start(trainer: "Trainer", epoch: int) -> None:
    """Epoch ``epoch`` (0-based) starts; its data loader has not been iterated yet."""


@hookspec(firstresult=True)
def ddpx_step_window(trainer: "Trainer", batch_index: int, num_batches: int) -> Optional[int]:
    """How many micro-batches, from ``batch_index`` on (of ``num_batches`` this epoch
    on this rank), make the next optimizer step. The trainer runs all but the last
    under ``no_sync`` and divides each back-propagated loss by this number, so the
    step's gradient is the window's mean (gradient accumulation). Called once per
    optimizer step. None (no plugin answers): 1."""


@hookspec(firstresult=True)
def ddpx_forward(trainer: "Trainer", batch: Any) -> "torch.Tensor":
    """Compute the loss of one micro-batch (runs inside ``trainer.autocast``).

    The trainer implements the body: :func:`ddpx.data.batches.model_loss` (tuple or dict
    batches; the loss function, or the model's own loss with ``loss.target: null``).
    A plugin may provide the loss instead, or wrap the body
    (``@hookimpl(wrapper=True)``) to change it.
    """


@hookspec(firstresult=True)
def ddpx_optimizer_step(trainer: "Trainer") -> Optional[bool]:
    """Clip (``trainer.clip_gradients()``) and step the optimizer; return True
    if the step was applied, False if skipped. Default: through ``trainer.scaler``
    (unscale, clip, ``scaler.step``, ``scaler.update``; False after an fp16
    overflow), or clip and ``optimizer.step()`` without fp16 AMP. Gradients are
    zeroed by the trainer afterwards."""


@hookspec
def ddpx_batch_end(
    trainer: "Trainer", batch_index: int, loss: "torch.Tensor", stepped: bool
) -> None:
    """A micro-batch finished; ``stepped`` tells whether the optimizer stepped.

    Runs after every micro-batch, once its optimizer step is done (for each
    micro-batch of the window, in order): for work every N steps, schedule a call
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
