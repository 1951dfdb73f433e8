"""The non-finite guard (``trainer.nonfinite``): a loss or weights that went NaN/inf stop
every rank with :class:`~ddpx.errors.TrainingDiverged` (``stop``), or are warned about
once per epoch (``warn``).

The callers (the trainer at the epoch's end, the checkpoint plugin between its stop checks
and before every save) ask on every rank at the same boundary, from all-reduced values
only, so every rank takes the same decision."""

from __future__ import annotations

from ..errors import TrainingDiverged
from ..plugin.shared import LAST_FINITE_CHECKPOINT


class NonfiniteGuard:
    def __init__(self, trainer):
        self.trainer = trainer
        self.warned: dict = {}  # what (loss, weights) was warned about in which epoch

    def loss(self, where: str) -> None:
        if self.trainer.config.trainer.nonfinite == "warn":
            self._warn_once_per_epoch("loss", f"the loss went non-finite {where}{self._first_nonfinite_gradient()}; "
                                      "going on (trainer.nonfinite=warn)")
            return
        raise TrainingDiverged(f"the loss went non-finite {where}{self._first_nonfinite_gradient()}; "
                               f"{self._finite_checkpoint_advice()}")

    def weights(self, where: str) -> None:
        if self.trainer.config.trainer.nonfinite == "warn":
            self._warn_once_per_epoch("weights", f"the weights are non-finite {where}: no checkpoint written "
                                      "(trainer.nonfinite=warn)")
            return
        raise TrainingDiverged(f"the weights went non-finite {where}{self._first_nonfinite_gradient()}; "
                               f"{self._finite_checkpoint_advice()}")

    def _first_nonfinite_gradient(self) -> str:
        """Where the gradients first went non-finite, for the guard's message (one host read)."""
        trainer = self.trainer
        if trainer.scaler.is_enabled() or trainer._grad_norms is None:
            return ""  # fp16 AMP skips such steps: its non-finite gradients are overflows, not divergence
        found = trainer._grad_norms.first_nonfinite()
        if found is not None:
            return f"; the first non-finite gradient was {found[0]}'s, at optimizer step {found[1]}"
        if trainer.config.trainer.grad_clip:
            return "; every step's gradients were finite"
        return " (set trainer.grad_clip to check every step's gradients and name the first non-finite one)"

    def _warn_once_per_epoch(self, kind: str, message: str) -> None:
        if self.warned.get(kind) != self.trainer.epoch:
            self.warned[kind] = self.trainer.epoch
            self.trainer.log.warning(message)

    def _finite_checkpoint_advice(self) -> str:
        checkpoint = self.trainer.shared.get(LAST_FINITE_CHECKPOINT)
        if checkpoint is None:
            found = "no checkpoint with finite weights exists"
        else:
            found = f"newest checkpoint with finite weights: {checkpoint} (a rerun resumes from it)"
        return (f"{found}; automatic restarts (--max-restarts) end at once, as they would diverge again: "
                "lower optimizer.args.lr, set trainer.grad_clip or fix the data, then run again "
                "(trainer.nonfinite=warn goes on instead)")
