"""A plugin that times, on each rank, where a pipeline stage's step goes (for
benchmarks/bench_model_parallel.py): per optimizer step, cumulative seconds

* ``schedule_s``: inside the pipeline schedule's ``step`` (``PipelineStrategy._run``): every
  micro-batch's forward and backward on this rank's stages and the transfers between stages;
* ``wait_s``: of that, blocked in the schedule's point-to-point waits
  (``torch.distributed.pipelining.schedules._wait_batch_p2p``: receiving the previous stage's
  activation or the next stage's gradient, and completing sends), the stage's idle time;
* ``compute_s``: of that, in the stages' ``forward_one_chunk``, ``backward_one_chunk`` and
  ``backward_weight_one_chunk`` (the model's own work);
* ``compute_cpu_s``, ``forward_backward_cpu_s``: the CPU time of the rank's main thread
  (``time.thread_time``) in the stages' compute and in ``forward_backward``: where the wall
  time is well above it, the rank was ready to run but other processes had the cores;
* ``forward_backward_s``: the whole of ``Strategy.forward_backward`` (the schedule, then the
  loss broadcast and the sum of the non-block gradients over the stages; under ddp: the forward
  and backward with DDP's all-reduce);
* ``step_end_s``: when the optimizer step ended (``time.perf_counter``).

Written at the end of training into ``run_dir/stage_timing_rank<r>.json``. Usage:
    PYTHONPATH=benchmarks ddpx train examples/char_gpt/config.yaml trainer.strategy=pipeline \\
        'plugins.enable=[stage_timing]'
"""

import functools
import json
import time

from ddpx import hookimpl

totals = {"schedule_s": 0.0, "wait_s": 0.0, "compute_s": 0.0, "compute_cpu_s": 0.0, "forward_backward_s": 0.0,
          "forward_backward_cpu_s": 0.0}
steps: list = []


def _timed(fn, key, cpu_key=None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start
            if cpu_key:
                totals[cpu_key] += time.thread_time() - cpu

    wrapper.__timed__ = True
    return wrapper


def _patch(owner, name, key, cpu_key=None):
    fn = getattr(owner, name, None)
    if fn is not None and not getattr(fn, "__timed__", False):
        setattr(owner, name, _timed(fn, key, cpu_key))


@hookimpl
def ddpx_train_start(trainer):
    strategy = trainer.strategy
    strategy.forward_backward = _timed(strategy.forward_backward, "forward_backward_s", "forward_backward_cpu_s")
    if trainer.config.trainer.strategy != "pipeline":
        return
    from torch.distributed.pipelining import schedules, stage

    _patch(schedules, "_wait_batch_p2p", "wait_s")  # looked up as a module global by every schedule
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        _patch(stage._PipelineStageBase, name, "compute_s", "compute_cpu_s")
    strategy._run = _timed(strategy._run, "schedule_s")


@hookimpl(wrapper=True)
def ddpx_optimizer_step(trainer):
    applied = yield
    steps.append({**totals, "step_end_s": time.perf_counter()})
    return applied


@hookimpl
def ddpx_train_end(trainer):
    strategy = trainer.strategy
    record = {"strategy": trainer.config.trainer.strategy, "rank": trainer.rank, "world_size": trainer.world_size,
              "steps": steps}
    if trainer.config.trainer.strategy == "pipeline":
        record.update(stages=getattr(strategy, "stage_ids", None), num_stages=getattr(strategy, "num_stages", None))
    (trainer.run_dir / f"stage_timing_rank{trainer.rank}.json").write_text(json.dumps(record))
