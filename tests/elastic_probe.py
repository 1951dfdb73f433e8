"""Test plugin for the elastic tests (``plugins.enable: [elastic_probe]``, tests/ on PYTHONPATH).

Records which training samples every optimizer step consumed, per rank and per
attempt, and can inject one failure at a chosen step:

* ``action: kill``        SIGKILL this worker (no cleanup can run);
* ``action: raise``       raise an exception in this worker;
* ``action: term_agent``  SIGTERM the torchrun agent (``ddpx train``), which
  forwards it to every worker: the graceful-stop path;
* ``action: kill_agent``  SIGKILL the agent only (the OOM killer, ``kill -9``):
  its workers must stop by themselves;
* ``action: kill_node``   SIGKILL the agent, then this worker: a host dying
  (with one worker per node);
* ``action: hang``        sleep for an hour (a stuck rank that is still alive).

``rank: -1`` acts on every rank (e.g. the one worker of the node whose config
says so); ``step_sleep_s`` slows every step from ``at_step`` on down (every step
where none is set), so a run lasts long enough after the failure for a node to
rejoin or a stop to land, and no longer before it; no step sleeps once the file
``fast_file`` exists.

The failure happens once: ``marker`` names a file created just before it, and
an existing marker disables the action (a restarted attempt runs normally).

Files in ``record_dir``: ``steps-<label>-<attempt>-rank<r>.jsonl`` with one
``{"event": "start", ...}`` line (the step and epoch training resumed from, the pid)
and one ``{"event": "step", "epoch", "step", "indices"}`` line per optimizer
step; ``final-<label>.pt`` (rank 0's parameters at the end).
"""

import json
import os
import signal
import time
from pathlib import Path

import torch

from ddpx import hookimpl

_probe = {}


@hookimpl
def ddpx_config_defaults():
    return {"probe": {"record_dir": "", "label": "run", "action": "none", "at_step": -1, "rank": 0, "marker": "",
                      "step_sleep_s": 0.0, "fast_file": ""}}


@hookimpl
def ddpx_setup(trainer):
    cfg = trainer.config.section("probe")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = Path(cfg["record_dir"]) / f"steps-{cfg['label']}-{attempt}-rank{trainer.rank}.jsonl"
    _probe.update(cfg=cfg, file=open(path, "a", buffering=1), pending=[], step=None)


def _write(record):
    _probe["file"].write(json.dumps(record) + "\n")
    _probe["file"].flush()
    os.fsync(_probe["file"].fileno())  # a SIGKILL right after must not lose it


@hookimpl
def ddpx_train_start(trainer):  # the checkpoint plugin (tryfirst) has restored by now
    features = trainer.train_set.tensors[0]
    _probe["index"] = {row.numpy().tobytes(): i for i, row in enumerate(features)}
    _probe["step"] = trainer.global_step
    _write({"event": "start", "world_size": trainer.world_size, "step": trainer.global_step, "epoch": trainer.epoch,
            "pid": os.getpid(), "time": time.time()})


@hookimpl(wrapper=True)
def ddpx_forward(trainer, batch):
    index = _probe["index"]
    _probe["pending"].extend(index[row.cpu().numpy().tobytes()] for row in batch[0])
    return (yield)


@hookimpl
def ddpx_batch_end(trainer, batch_index, loss, stepped):
    if trainer.global_step == _probe["step"]:
        return  # inside an accumulation window
    _probe["step"] = trainer.global_step
    _write({"event": "step", "epoch": trainer.epoch, "step": trainer.global_step, "indices": _probe["pending"],
            "time": time.time()})
    _probe["pending"] = []
    cfg = _probe["cfg"]
    if trainer.global_step >= cfg["at_step"] and not (cfg["fast_file"] and os.path.exists(cfg["fast_file"])):
        time.sleep(cfg["step_sleep_s"])
    if cfg["action"] == "none" or trainer.global_step != cfg["at_step"] or cfg["rank"] not in (-1, trainer.rank):
        return
    marker = Path(cfg["marker"])
    if marker.exists():
        return
    marker.touch()
    if cfg["action"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif cfg["action"] == "raise":
        raise RuntimeError(f"probe: injected failure on rank {trainer.rank} at step {trainer.global_step}")
    elif cfg["action"] == "term_agent":
        os.kill(os.getppid(), signal.SIGTERM)
    elif cfg["action"] == "hang":
        time.sleep(3600)
    elif cfg["action"] == "kill_agent":
        os.kill(os.getppid(), signal.SIGKILL)
    elif cfg["action"] == "kill_node":
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


@hookimpl
def ddpx_train_end(trainer):
    if trainer.rank == 0:
        cfg = _probe["cfg"]
        torch.save(trainer.module.state_dict(), Path(cfg["record_dir"]) / f"final-{cfg['label']}.pt")
