"""torch.profiler over a few chosen optimizer steps on chosen ranks.

With ``profile.enabled``, each rank in ``profile.ranks`` runs
``torch.profiler.profile`` with ``torch.profiler.schedule(wait, warmup,
active)`` counted in optimizer steps from the start of training (or of the
resumed run): ``wait`` steps untouched, ``warmup`` steps traced and thrown
away, then ``active`` steps recorded. The profiler advances by a call
scheduled at each step boundary while it runs (``trainer.call_at_step``) and
stops after the last active step, so the rest of the run, and a run with the
profiler off, pay nothing.

What it writes, in ``run_dir/profile/``:

* ``rank<r>.<time>.pt.trace.json``: the trace, through
  ``torch.profiler.tensorboard_trace_handler``: TensorBoard's profiler plugin
  (``tensorboard --logdir run_dir/profile``) and Perfetto / ``chrome://tracing``
  open it. The comm hook's phases are named ranges in it (``ddpx::encode``,
  ``ddpx::collective``, ``ddpx::decode``: the Python and the native hook
  alike, recorded on their worker threads too);
* ``memory_rank<r>.html``: the memory timeline, on CUDA with ``memory: true``
  (``record_shapes`` and stacks are then recorded as the timeline needs);
* ``summary_rank<r>.txt``: the top operators by self time; rank 0 also logs
  this table once, when the profiler stops.

Per-run state: ``trainer.plugin("profiler").run`` (a :class:`ProfilerRun`, None when off
or on a rank not profiled; docs/plugins.md, "Per-run state").
"""

from __future__ import annotations

import os

from ddpx import hookimpl
from ddpx.errors import DdpxError

TOP_OPS = 15  # rows of the summary table


class ProfilerRun:
    """One rank's profiler: started at the start of training, stepped at each step
    boundary until its schedule is done, then stopped and summarised."""

    def __init__(self, trainer, cfg):
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.directory = os.path.join(str(trainer.run_dir), "profile")
        os.makedirs(self.directory, exist_ok=True)
        self.rank = trainer.rank
        self.steps, self.active = cfg["wait"] + cfg["warmup"] + cfg["active"], cfg["active"]
        self.start_step = 0  # global_step when the profiler started
        self.cuda = trainer.device.type == "cuda"
        self.memory_timeline = bool(cfg["memory"]) and self.cuda
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        trace_handler = tensorboard_trace_handler(self.directory, worker_name=f"rank{self.rank}")

        def on_trace_ready(prof):
            trace_handler(prof)
            if self.memory_timeline:
                prof.export_memory_timeline(os.path.join(self.directory, f"memory_rank{self.rank}.html"),
                                            device=str(trainer.device))

        self.profile = profile(
            activities=activities,
            schedule=schedule(wait=cfg["wait"], warmup=cfg["warmup"], active=cfg["active"], repeat=1),
            on_trace_ready=on_trace_ready,
            record_shapes=bool(cfg["record_shapes"]) or self.memory_timeline,
            profile_memory=bool(cfg["memory"]),
            with_stack=self.memory_timeline,
            # The comm hooks' phases run on their worker threads (Python and C++).
            experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True),
        )
        self.taken = 0
        self.running = False

    def start(self, trainer):
        self.profile.start()
        self.running, self.start_step = True, trainer.global_step
        trainer.call_at_step(trainer.global_step + 1, self.at_step)

    def at_step(self, trainer):
        self.profile.step()
        self.taken += 1
        if self.taken >= self.steps:
            self.stop(trainer)
        else:
            trainer.call_at_step(trainer.global_step + 1, self.at_step)

    def stop(self, trainer):
        """Stop (writes the trace if the active steps began) and summarise; once."""
        if not self.running:
            return
        self.running = False
        self.profile.stop()
        try:
            events = self.profile.key_averages()
        except Exception:  # nothing was recorded (training ended during wait/warmup)
            return
        if not len(events):
            return
        sort_by = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = events.table(sort_by=sort_by, row_limit=TOP_OPS)
        with open(os.path.join(self.directory, f"summary_rank{self.rank}.txt"), "w") as f:
            f.write(table + "\n")
        if trainer.rank == 0:
            first, last = self.start_step + self.steps - self.active + 1, self.start_step + self.taken
            trainer.log.info(f"profile of optimizer steps {first}..{last} on rank 0, top operators by self time "
                             f"(traces in {self.directory}):\n{table}")


class ProfilerPlugin:
    """``run``: the run's :class:`ProfilerRun`, or None (off, or this rank is not profiled)."""

    def __init__(self):
        self.run = None

    @hookimpl
    def ddpx_config_defaults(self):
        return {"profile": {"enabled": False, "wait": 1, "warmup": 1, "active": 3, "ranks": [0],
                            "record_shapes": False, "memory": False}}

    @hookimpl
    def ddpx_configure(self, config):
        cfg = config.section("profile")
        for key, least in (("wait", 0), ("warmup", 0), ("active", 1)):
            if cfg[key] < least:
                raise DdpxError(f"profile.{key} must be >= {least} (got {cfg[key]})")
        ranks = cfg["ranks"]
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
            raise DdpxError(f"profile.ranks must be a list of rank numbers, e.g. [0, 1] (got {ranks!r})")

    @hookimpl
    def ddpx_setup(self, trainer):
        cfg = trainer.config.section("profile")
        profiled = cfg["enabled"] and trainer.rank in cfg["ranks"]
        self.run = ProfilerRun(trainer, cfg) if profiled else None

    @hookimpl(trylast=True)  # after a checkpoint restored global_step: the steps count from here
    def ddpx_train_start(self, trainer):
        if self.run is not None:
            self.run.start(trainer)

    @hookimpl
    def ddpx_train_end(self, trainer):
        if self.run is not None:
            self.run.stop(trainer)

    @hookimpl
    def ddpx_exception(self, trainer, exc):
        run = self.run
        if run is not None and run.running:
            run.running = False
            try:
                run.profile.stop()
            except Exception:  # never hide the original error
                pass
