"""Test plugin for live recovery (``plugins.enable: [live_faults]``, tests/ on PYTHONPATH): records
every committed step and kills this replica group at a chosen point, as torchft's EventInjector.

Config section ``faults``: ``record_dir``, ``label`` (this group's), ``point`` and ``at_step``:
SIGKILL the torchrun agent and this worker (a host dying) at optimizer step ``at_step`` (the step
being trained, ``global_step + 1``; 0: the step after this process's first committed one, whatever
step a heal brought it to), at one of

* ``before_exchange``  after the backward passes, before the gradients cross the groups;
* ``in_collective``    inside the exchange, with its collective in flight;
* ``after_exchange``   after the exchange, before the groups decide on the commit;
* ``checkpoint``       while the checkpoint after that step is being written;
* ``heal_send``        while this group's state is read for a group that heals from it;
* ``heal_receive``     while this group loads the state it healed from.

``step_sleep_s`` slows every step, ``alone_sleep_s`` those a group trains alone (so a run lasts
until a restarted group is back, and no longer); neither once the file ``fast_file`` exists (a
benchmark's failures are over: the run finishes at full speed). ``alone_wait_for`` (a glob): a group
alone waits after each step until such a file exists (a restarted group's records: it is up).

Files: ``<record_dir>/<label>-<pid>.jsonl``, one ``{"epoch", "step", "before", "after", "groups",
"indices"}`` line per committed step: the sampler's position before and after it (the global
batches it consumed) and the training samples this rank trained in it; a ``{"event": "healed",
"epoch", "step"}`` line where the group took a peer's state (its records of steps up to that one
may belong to a branch the heal replaced: two quorums that formed apart); a first ``{"event": "ready",
"epoch", "step", "time"}`` line when training starts (the process is up; benchmarks/bench_recovery.py
times a restarted group from it). Datasets other than a TensorDataset record no ``indices``.
"""

import glob
import json
import os
import signal
import time
from pathlib import Path

from ddpx import hookimpl

_state = {}


@hookimpl
def ddpx_config_defaults():
    return {"faults": {"record_dir": "", "label": "group", "point": "none", "at_step": -1, "step_sleep_s": 0.0,
                       "alone_sleep_s": 0.0, "fast_file": "", "alone_wait_for": ""}}


def _die(point, step=None):
    cfg = _state["cfg"]
    step = _state["trainer"].global_step + 1 if step is None else step
    if cfg["point"] == point and (step == cfg["at_step"] or cfg["at_step"] == 0 and _state.get("trained")):
        os.kill(os.getppid(), signal.SIGKILL)  # the agent first: nothing restarts this group
        os.kill(os.getpid(), signal.SIGKILL)


@hookimpl
def ddpx_setup(trainer):
    cfg = trainer.config.section("faults")
    path = Path(cfg["record_dir"]) / f"{cfg['label']}-{os.getpid()}.jsonl"
    _state.update(cfg=cfg, trainer=trainer, file=open(path, "a", buffering=1), pending=[], before=None)


@hookimpl
def ddpx_train_start(trainer):
    tensors = getattr(trainer.train_set, "tensors", None)  # a TensorDataset (digits); else no sample indices
    _state["index"] = {row.numpy().tobytes(): i for i, row in enumerate(tensors[0])} if tensors else None
    _write({"event": "ready", "epoch": trainer.epoch, "step": trainer.global_step, "time": time.time()})


def _inject(trainer):
    """Wrap the replica groups' steps (made when training starts, after the plugins' hook)."""
    groups = trainer.strategy.groups
    codec, across, manager = groups.codec, groups.across, groups.manager

    exchange = codec.exchange

    def faulty_exchange(flat, across):
        _die("before_exchange")
        ok = exchange(flat, across)
        _die("after_exchange")
        return ok

    codec.exchange = faulty_exchange
    run = across._run

    def faulty_run(start):
        def started():
            work = start()
            _die("in_collective")
            return work
        return run(started)

    across._run = faulty_run
    send, load = manager._user_state_dicts["default"], manager._load_state_dict_fns["default"]

    def faulty_send():
        state = send()
        _die("heal_send")
        return state

    def faulty_load(state):
        _die("heal_receive")
        load(state)
        _write({"event": "healed", "epoch": trainer.epoch, "step": trainer.global_step})

    manager._user_state_dicts["default"], manager._load_state_dict_fns["default"] = faulty_send, faulty_load


@hookimpl
def ddpx_epoch_start(trainer, epoch):
    if not _state.get("injected"):  # before the first quorum, which may heal
        _state["injected"] = True
        _inject(trainer)


@hookimpl(wrapper=True)
def ddpx_step_window(trainer, batch_index, num_batches):
    _state["pending"] = []  # a dropped step's samples were not trained
    _state["before"] = trainer.train_loader.batch_sampler.consumed
    return (yield)


@hookimpl(wrapper=True)
def ddpx_forward(trainer, batch):
    index = _state["index"]
    if index is not None:
        _state["pending"].extend(index[row.cpu().numpy().tobytes()] for row in batch[0])
    return (yield)


@hookimpl
def ddpx_batch_end(trainer, batch_index, loss, stepped):
    if not stepped:
        return
    sampler = trainer.train_loader.batch_sampler
    record = {"epoch": trainer.epoch, "step": trainer.global_step, "before": _state["before"],
              "after": sampler.consumed, "groups": trainer.strategy.groups.groups, "indices": _state["pending"],
              "time": time.time()}
    _write(record)
    _state["trained"] = True  # at_step 0: the step after this process's first committed one
    alone = trainer.strategy.groups.groups == 1
    cfg = _state["cfg"]
    if not (cfg["fast_file"] and os.path.exists(cfg["fast_file"])):
        time.sleep(cfg["alone_sleep_s" if alone else "step_sleep_s"])
    waited = 0.0
    while alone and cfg["alone_wait_for"] and not glob.glob(cfg["alone_wait_for"]) and waited < 300:
        time.sleep(0.1)  # alone until a group the test restarts is up (its "ready" record), however slow
        waited += 0.1


def _write(record):
    _state["file"].write(json.dumps(record) + "\n")
    _state["file"].flush()
    os.fsync(_state["file"].fileno())  # a SIGKILL right after must not lose it


@hookimpl
def ddpx_state_dict(trainer):
    _die("checkpoint", trainer.global_step)  # after the step: the checkpoint of step ``at_step``
    return None
