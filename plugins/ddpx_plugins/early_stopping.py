"""Early stopping: end training when an epoch metric stops improving.

At each epoch end with the monitored metric (``accuracy``, ``eval_loss``,
``loss``, or any key a plugin adds to the epoch's metrics), the metric either
improves on the best so far by more than ``min_delta`` (``mode``: ``max`` or
``min``; ``auto``: ``min`` for names with "loss") or adds one to the wait.
After ``patience`` epochs without improvement every rank ends training after
that epoch (``trainer.end_training``): the final checkpoint is written and the
run exits 0. Epochs without the metric (``trainer.eval_every_epochs`` > 1)
do not count. Rank 0's decision is broadcast, so every rank stops at the
same epoch boundary even if a plugin's metric differed between ranks.

Each epoch line of ``metrics.jsonl`` gets ``early_stopping_wait`` and, in the
last one, ``early_stopped: true``. The best value and the wait are in the
checkpoint (key ``early_stopping``): a resumed run continues its patience,
and ``ddpx train`` on a run that stopped early does not train further.

Config section ``early_stopping``: ``monitor`` (null: off), ``patience`` (3),
``min_delta`` (0.0), ``mode`` (``auto`` | ``max`` | ``min``).
"""

from ddpx import hookimpl
from ddpx.errors import DdpxError
from ddpx.train.monitor import Monitor

SECTION = "early_stopping"


class EarlyStopping:
    """What one run of the plugin holds (``trainer.plugin("early_stopping").state``)."""

    def __init__(self, monitor: Monitor, patience: int):
        self.monitor = monitor
        self.patience = patience
        self.best = None
        self.wait = 0
        self.stopped = False

    def update(self, value: float) -> None:
        if self.monitor.improves(value, self.best):
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        self.stopped = self.wait >= self.patience

    def reason(self) -> str:
        return (f"early stopping: {self.monitor.name} has not improved by more than {self.monitor.min_delta:g} "
                f"for {self.patience} epochs (best {self.best:.6g})")


class EarlyStoppingPlugin:
    """``state``: the run's :class:`EarlyStopping`, or None when no metric is monitored."""

    def __init__(self):
        self.state = None

    @hookimpl
    def ddpx_config_defaults(self):
        return {SECTION: {"monitor": None, "patience": 3, "min_delta": 0.0, "mode": "auto"}}

    @hookimpl
    def ddpx_configure(self, config):
        cfg = config.section(SECTION)
        if cfg["patience"] < 1:
            raise DdpxError(f"early_stopping.patience must be >= 1, got {cfg['patience']}")
        Monitor.from_config(cfg, SECTION)  # one-line errors

    @hookimpl
    def ddpx_setup(self, trainer):
        cfg = trainer.config.section(SECTION)
        monitor = Monitor.from_config(cfg, SECTION)
        self.state = EarlyStopping(monitor, cfg["patience"]) if monitor is not None else None

    @hookimpl
    def ddpx_train_start(self, trainer):
        state = self.state
        if state is not None and state.stopped:  # restored from a run that already stopped early
            trainer.end_training(state.reason())

    @hookimpl(tryfirst=True)  # before the logging plugin writes the epoch's metrics and the checkpoint saves
    def ddpx_epoch_end(self, trainer, epoch, metrics):
        state = self.state
        if state is None:
            return
        value = state.monitor.value(metrics)
        if value is None:
            return  # no evaluation this epoch
        state.update(value)
        if trainer.world_size > 1:
            import torch.distributed as dist

            box = [(state.best, state.wait, state.stopped)]
            dist.broadcast_object_list(box, src=0)
            state.best, state.wait, state.stopped = box[0]
        metrics["early_stopping_wait"] = state.wait
        if state.stopped:
            metrics["early_stopped"] = True
            trainer.end_training(state.reason())

    def state_dict(self, trainer):
        state = self.state
        if state is None:
            return None
        return {"monitor": state.monitor.name, "best": state.best, "wait": state.wait, "stopped": state.stopped}

    def load_state_dict(self, trainer, saved):
        mine = self.state
        if mine is None:
            return
        if saved["monitor"] != mine.monitor.name:
            trainer.log.warning(f"early stopping now watches {mine.monitor.name}, the checkpoint's counters are for "
                        f"{saved['monitor']}: starting its patience afresh")
            return
        mine.best, mine.wait, mine.stopped = saved["best"], saved["wait"], saved["stopped"]
