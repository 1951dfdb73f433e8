"""The logging plugin's per-run state, :class:`MetricsLog`: rank 0's step and epoch
records (what goes to every backend), the calls it schedules, and the run's files at the end."""

import math
import os
import time

from ddpx.plugin.shared import COMM_HOOK, EMA_WEIGHTS_FILE, LAST_FINITE_CHECKPOINT

from .progress import BAR_SECONDS, MAX_BAR_STEPS, PlainProgress, ProgressBar

PLAIN_CALL_SECONDS = 1.0  # plain progress lines: whether one is due is asked about this often


class MetricsLog(ProgressBar):
    """What one run of the logging plugin holds. Rank 0 shows the bar and feeds the
    backends; other ranks do nothing per step."""

    def __init__(self, every_steps, progress, samples_per_batch):
        super().__init__()
        self.every_steps = every_steps
        self.progress = progress
        self.samples_per_batch = samples_per_batch
        self.backends: list = []  # rank 0's Backend objects, metrics.jsonl first
        self.comm_counted = (0, 0)  # (wire bytes, steps) of the comm hook at the last step line
        self.comm_at_epoch = (0, 0, 0)  # (wire bytes, fp32 wire bytes, steps) at the last epoch line
        self.window = None  # the trainer's LossWindow since the last step line (rank 0)
        self.epoch_base = 0  # micro-batches of the window from before this epoch: not in the throughput
        self.last_call = (0, 0.0)  # (global_step, perf_counter) of the last scheduled call
        self.mark = time.perf_counter()  # start of the throughput's time span
        self.start = self.mark

    def log_metrics(self, kind, step, values):
        for backend in self.backends:
            backend.log_metrics(kind, step, values)

    # --- scheduled on rank 0: nothing per step -------------------------------------------

    def schedule(self, trainer):
        step = trainer.global_step
        due = step + self.bar_steps if self.progress else None
        if self.every_steps:
            line = (step // self.every_steps + 1) * self.every_steps
            due = line if due is None else min(due, line)
            trainer.watch_grad_norm(line)  # that step's gradient norm, computed then (every step with grad_clip)
        if due is not None:
            trainer.call_at_step(due, self.at_step)

    def at_step(self, trainer):
        now, step = time.perf_counter(), trainer.global_step
        last_step, last_time = self.last_call
        self.last_call = (step, now)
        if self.bar is not None:
            self.advance_bar()
            step_s = (now - last_time) / max(1, step - last_step)
            every_s = PLAIN_CALL_SECONDS if isinstance(self.bar, PlainProgress) else BAR_SECONDS
            self.bar_steps = max(1, min(MAX_BAR_STEPS, int(every_s / max(step_s, 1e-9))))
        if self.every_steps and step % self.every_steps == 0:
            self.write_step_line(trainer, now)
        self.schedule(trainer)

    def write_step_line(self, trainer, now):
        loss_sum, count = self.window.take()
        self.bar_shown = 0
        batches, self.epoch_base = count - self.epoch_base, 0
        mean_loss = loss_sum.item() / count if count else math.nan  # the only host sync, every every_steps steps
        samples_per_s = batches * self.samples_per_batch / max(now - self.mark, 1e-9)
        self.mark = now
        record = {
            "epoch": trainer.epoch,
            "loss": mean_loss,
            "lr": trainer.optimizer.param_groups[0]["lr"],
            "samples_per_s": samples_per_s,
            "time": now - self.start,
        }
        if trainer.grad_norm_step == trainer.global_step:
            record["grad_norm"] = trainer.grad_norm.item()
        record.update(self.training_state(trainer))
        self.log_metrics("step", trainer.global_step, record)
        if self.bar is not None:
            self.postfix["samples_s"] = f"{samples_per_s:.0f}"
            self.bar.set_postfix(self.postfix, refresh=False)

    def training_state(self, trainer):
        """The AMP scale and the comm hook's traffic since the last step line."""
        state = {}
        if trainer.scaler.is_enabled():
            state["amp_scale"] = trainer.scaler.get_scale()
        hook = trainer.shared.get(COMM_HOOK)
        stats = hook.stats() if hook is not None else None
        if stats is not None:
            wire, steps = self.comm_counted
            if stats["steps"] > steps:
                state["comm_wire_bytes_per_step"] = (stats["wire_bytes"] - wire) / (stats["steps"] - steps)
            if stats["compression"] is not None:
                state["comm_compression"] = stats["compression"]
            self.comm_counted = (stats["wire_bytes"], stats["steps"])
        return state

    def count_comm_from_here(self, trainer):
        """Training starts (maybe resumed, with the comm hook's totals restored): the step and
        epoch lines count the traffic from here."""
        hook = trainer.shared.get(COMM_HOOK)
        stats = hook.stats() if hook is not None else None
        if stats:
            self.comm_counted = (stats["wire_bytes"], stats["steps"])
            self.comm_at_epoch = (stats["wire_bytes"], stats.get("fp32_wire_bytes") or 0, stats["steps"])

    def comm_this_epoch(self, trainer):
        """The epoch line's ``comm ...`` part: the bytes this rank sent per step since the previous
        epoch line against what an fp32 allreduce of the same gradients sends; "" without a comm hook."""
        hook = trainer.shared.get(COMM_HOOK)
        stats = hook.stats() if hook is not None else None
        if not stats or stats.get("fp32_wire_bytes") is None:
            return ""
        now = (stats["wire_bytes"], stats["fp32_wire_bytes"], stats["steps"])
        (wire, fp32, steps), self.comm_at_epoch = (a - b for a, b in zip(now, self.comm_at_epoch)), now
        if steps <= 0 or wire <= 0:
            return ""
        ratio = fp32 / wire
        versus = "the same as" if abs(ratio - 1) < 0.005 else \
            f"{ratio:.2f}x less than" if ratio > 1 else f"{1 / ratio:.2f}x more than"
        return f"; comm {_bytes(wire / steps)}/step, {versus} fp32 allreduce ({_bytes(fp32 / steps)})"

    def close(self, trainer=None, failed=False):
        """Close the bar and every backend; ``trainer`` (a normal end): hand them the
        run's files first (``metrics.jsonl``, the final checkpoint, the EMA weights, the trained
        model's ``model/``)."""
        self.close_bar()
        backends, self.backends = self.backends, []
        if backends:
            backends[0].file.flush()  # metrics.jsonl, complete before it is copied
        files = _run_files(trainer, backends[0].path) if trainer is not None and backends else []
        for backend in backends:
            try:
                for path in files:
                    backend.log_file(path)
            finally:
                backend.close(failed=failed)


def _bytes(n):
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _run_files(trainer, metrics_path):
    """The files (and the ``model/`` directory) a tracker gets at the end of a run, where they exist."""
    from ddpx.rank.model_files import MODEL_DIR

    files = [metrics_path, trainer.shared.get(LAST_FINITE_CHECKPOINT), trainer.shared.get(EMA_WEIGHTS_FILE)]
    model = os.path.join(trainer.run_dir, MODEL_DIR)
    return [path for path in files if path and os.path.isfile(path)] + ([model] if os.path.isdir(model) else [])

