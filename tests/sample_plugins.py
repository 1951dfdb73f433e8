"""Plugins the tests load by import path (``plugins.enable=[sample_plugins.NAME]``), in one
module of their own so that no test module doubles as a plugin module.

In-process runs and the tests import this module by the same name (pytest puts tests/
on ``sys.path``), so what a plugin records in ``EVENTS`` is what the test reads.
Runs in worker processes need tests/ on ``PYTHONPATH`` and take their settings from
the environment variables below.
"""

import json
import os
import signal

from ddpx import hookimpl

EVENTS: list = []  # what the in-process plugins below saw, in order; a test clears it first

NAN_FROM_ENV = "DDPX_TEST_NAN_FROM_STEP"
SCORES_ENV = "DDPX_TEST_SCORES"


class NanLossFromStep:
    """The loss turns NaN from the optimizer step named in DDPX_TEST_NAN_FROM_STEP on."""

    @hookimpl(wrapper=True)
    def ddpx_forward(self, trainer, batch):
        loss = yield
        if trainer.global_step >= int(os.environ[NAN_FROM_ENV]):
            return loss * float("nan")
        return loss


class ScriptedScore:
    """Adds ``score`` to each epoch's metrics from the list in DDPX_TEST_SCORES."""

    @hookimpl(tryfirst=True)
    def ddpx_epoch_end(self, trainer, epoch, metrics):
        metrics["score"] = json.loads(os.environ[SCORES_ENV])[epoch]


class Scheduler:
    """Schedules calls at train start; records them and every batch end."""

    @hookimpl
    def ddpx_train_start(self, trainer):
        def call(name, again_at=None):
            def callback(t):
                EVENTS.append(("call", name, t.global_step, t.batch_index))
                if again_at is not None:
                    t.call_at_step(again_at(t), call(name + "-again"))
            return callback

        trainer.call_at_step(3, call("b"))
        trainer.call_at_step(1, call("c"))
        trainer.call_at_step(3, call("a", again_at=lambda t: t.global_step))  # a step already reached
        trainer.call_at_step(7, call("late"))
        trainer.call_at_step(100, call("never"))  # after max_steps

    @hookimpl
    def ddpx_batch_end(self, trainer, batch_index, loss, stepped):
        EVENTS.append(("batch_end", batch_index, trainer.global_step))


class LossRecorder:
    """Records (epoch, global step, stepped, loss) at every batch end."""

    @hookimpl
    def ddpx_batch_end(self, trainer, batch_index, loss, stepped):
        EVENTS.append((trainer.epoch, trainer.global_step, stepped, loss.item()))


class RaisesAtEpochStart:
    @hookimpl
    def ddpx_epoch_start(self, trainer, epoch):
        raise RuntimeError("broken on purpose")


class RaisesOnRank1AtStep3:
    """Rank 1 raises after its third optimizer step; the other ranks are stopped by its failure."""

    @hookimpl
    def ddpx_batch_end(self, trainer, batch_index, loss, stepped):
        if trainer.rank == 1 and trainer.global_step == 3:
            raise RuntimeError("broken on purpose on rank 1")


class SigtermAtBatch:
    """Sends this process SIGTERM at the end of batch 2."""

    signum = signal.SIGTERM

    @hookimpl
    def ddpx_batch_end(self, trainer, batch_index, loss, stepped):
        if batch_index == 2:
            os.kill(os.getpid(), self.signum)


class SighupAtBatch(SigtermAtBatch):
    """Sends this process SIGHUP (a closed terminal, forwarded by torchrun) at the end of batch 2."""

    signum = signal.SIGHUP


# Batch-end implementations in pluggy's three orderings, two of them taking a
# subset of the hook's arguments in another order than the hookspec's.
class FirstAtBatchEnd:
    @hookimpl(tryfirst=True)
    def ddpx_batch_end(self, trainer, batch_index, loss, stepped):
        EVENTS.append(("first", batch_index, stepped, trainer.global_step, round(float(loss), 6)))


class SubsetAtBatchEnd:
    @hookimpl
    def ddpx_batch_end(self, stepped, trainer):
        EVENTS.append(("subset", stepped, trainer.global_step))


class LastAtBatchEnd:
    @hookimpl(trylast=True)
    def ddpx_batch_end(self, loss, batch_index):
        EVENTS.append(("last", batch_index, round(float(loss), 6)))


class GradNormRecorder:
    """Records into EVENTS ``(step, total gradient norm)`` of every optimizer step, computed
    by torch's own ``get_total_norm`` before the trainer clips and steps."""

    @hookimpl
    def ddpx_optimizer_step(self, trainer):
        import torch

        grads = [p.grad for p in trainer.module.parameters() if p.grad is not None]
        EVENTS.append((trainer.global_step + 1, float(torch.nn.utils.get_total_norm(grads))))
        return None  # the trainer clips and steps


class NanGradAtStep:
    """Optimizer step 3 gets a NaN in the gradient of ``net.2.weight`` (the second layer)."""

    @hookimpl
    def ddpx_optimizer_step(self, trainer):
        if trainer.global_step + 1 == 3:
            trainer.module.net[2].weight.grad[0, 0] = float("nan")
        return None


class WeightRecorder:
    """Records into EVENTS ``(global_step, [parameter copies])``: the initial weights at
    the start of training, then the weights after every optimizer step."""

    @hookimpl
    def ddpx_train_start(self, trainer):
        EVENTS.append((trainer.global_step, [p.detach().clone() for p in trainer.module.parameters()]))

    @hookimpl
    def ddpx_batch_end(self, trainer, stepped):
        if stepped:
            EVENTS.append((trainer.global_step, [p.detach().clone() for p in trainer.module.parameters()]))
