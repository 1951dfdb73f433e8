"""What a run holds of its compression method: :class:`CommState`.

Under ddp that is the comm hook's state (ddpx/comm_hooks/state.py, ``HookState``), under
fsdp the gradient reduce-scatter (ddpx/comm_hooks/reduce_scatter.py,
``CompressedReduceScatter``). The trainer and its plugins use only this interface:
``name``, ``method`` (its descriptor, ddpx/comm_hooks/registry.py), ``opts``, ``pair``,
``stats``, ``state_dict`` / ``load_state_dict`` and ``close``.

Pairing. ``state.pair(optimizer)`` tells the state which optimizer steps with the
gradients it averages, before the first step (``ddpx train``: the comm_hook plugin, at
``ddpx_train_start``, after a checkpoint was restored). It resolves the ``auto`` options
that depend on the optimizer (int8's ``block_size``: 64 with an Adam-family optimizer,
else 256; powersgd's ``rank``: 16, else 4) and hands a method that needs its own
optimizer (``onebit_adam``) to it. An ``auto`` never paired is fixed at its first use (the
first bucket) at the value without an Adam-family optimizer, said in one line; a value
once chosen (by pairing, by a loaded state dict, by use) stays, and a later pairing that
would change it says so once.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..errors import DdpxError

log = logging.getLogger("ddpx.comm_hooks")


def adam_family(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` divides by a second moment as Adam does (it has ``betas``:
    Adam, AdamW, NAdam, RAdam, Adamax, and most third-party Adams)."""
    return "betas" in getattr(optimizer, "defaults", {})


def _on_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class AutoOptions:
    """The values of a state's ``auto`` options that depend on the optimizer (those whose
    :class:`~ddpx.comm_hooks.options.Option` names ``auto = (without, with Adam)``).

    A value is chosen once: by :meth:`pair`, by :meth:`restore` (a loaded state dict,
    which wins while the value is unused), or at the first :meth:`use`. A scope's stage-2
    state shares its outer state's object (``LossyState.stage2``)."""

    def __init__(self, what: str, options: dict, opts: dict):
        self.what = what  # "comm hook 'int8'"
        self.choices = {k: options[k].auto for k, v in opts.items() if v == "auto" and options[k].auto}
        self.values: dict = {}
        self.why: dict[str, str] = {}  # how each value was chosen, for the warning of a late pairing
        self.used = False
        self._said: set[str] = set()

    def value(self, key: str):
        """The value of ``key`` now: the chosen one, or the one without an Adam-family optimizer."""
        return self.values.get(key, self.choices[key][0])

    def chosen(self, key: str) -> bool:
        return key in self.values

    def pair(self, optimizer) -> None:
        adam = optimizer is not None and adam_family(optimizer)
        kind = type(optimizer).__name__ if optimizer is not None else "no optimizer"
        for key, choice in self.choices.items():
            want = choice[adam]
            if key not in self.values:
                self.values[key], self.why[key] = want, f"paired with {kind}"
            elif self.values[key] != want:
                self._keep(key, want, f"pairing with {kind}")

    def restore(self, key: str, value) -> None:
        """A value from a state dict: a resumed run codes as the saved one did."""
        if key not in self.choices or value is None:
            return
        if not self.used:
            self.values[key], self.why[key] = value, "restored from a state dict"
        elif self.values[key] != value:
            self._keep(key, value, "the loaded state dict")

    def use(self) -> None:
        """The first use (a layout, a reduce-scatter): every value not chosen yet is fixed
        at the one without an Adam-family optimizer, said once on rank 0."""
        if self.used:
            return
        self.used = True
        missing = [k for k in self.choices if k not in self.values]
        for key in missing:
            self.values[key], self.why[key] = self.choices[key][0], "not paired before its first use"
        if missing and _on_rank0():
            said = ", ".join(f"{k} auto is {self.choices[k][0]} ({self.choices[k][1]} with an Adam-family optimizer)"
                             for k in missing)
            log.warning("%s: %s: no optimizer was paired with it before its first step; call state.pair(optimizer) "
                        "before training (docs/comm_hooks.md)", self.what, said)

    def _keep(self, key: str, other, source: str) -> None:
        if key in self._said:
            return
        self._said.add(key)
        if _on_rank0():
            log.warning("%s: %s auto stays %s (%s); %s would make it %s, but a value once chosen stays: pair "
                        "once, before the first step", self.what, key, self.values[key], self.why[key], source, other)


class CommState:
    """Base of every comm state a run holds (see the module docstring).

    ``method``: the descriptor (ddpx/comm_hooks/registry.py); ``opts``: the options,
    checked and completed; ``auto_options``: the optimizer-dependent ``auto`` values."""

    def __init__(self, method, opts: dict, sharded: bool = False):
        """``sharded``: this is the method's sharded form, which takes its ``sharded_options``."""
        self.method = method
        self.opts = method.check_options(opts, sharded=sharded)
        what = f"comm hook {method.name!r}" + (" under trainer.strategy=fsdp" if sharded else "")
        self.auto_options = AutoOptions(what, method.options, self.opts)

    @property
    def name(self) -> str:
        return self.method.name

    def option(self, key: str):
        """The value of option ``key`` now: the option, or for ``auto`` the value chosen so far
        (the one without an Adam-family optimizer until pairing chose one)."""
        if key in self.auto_options.choices:
            return self.auto_options.value(key)
        return self.opts[key]

    def pair(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Pair with the optimizer that steps with these gradients, before the first step: it
        resolves the ``auto`` options; a method that needs its own optimizer
        (``Method.optimizer``) refuses any other in one line. ``None``: no optimizer steps with
        them (a check, a timing, ``ddpx.fused_allreduce``): the values without one."""
        if self.method.optimizer is not None:
            from ..imports import resolve

            if not isinstance(optimizer, resolve(self.method.optimizer, "optimizer")):
                raise DdpxError(f"comm hook {self.name!r} averages the gradients through its optimizer: pair it "
                                f"with {self.method.optimizer}, not {type(optimizer).__name__}")
        self.auto_options.pair(optimizer)

    def stats(self) -> dict:
        """Totals since creation; at least ``wire_bytes`` (what this rank sent),
        ``fp32_wire_bytes`` (what fp32's collective would have sent: None before the first
        one), ``steps`` and ``compression``."""
        raise NotImplementedError

    def state_dict(self) -> dict | None:
        """What to checkpoint, or None (nothing)."""
        return None

    def load_state_dict(self, sd: dict) -> None:
        pass

    def close(self) -> None:
        """End what the state runs (threads); it must not be used after."""
