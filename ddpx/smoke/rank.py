"""One rank of the smoke run (``python -m ddpx.smoke``, started by torchrun): the stages,
each recorded in ``<run_dir>/smoke/rank<N>.json`` as it ends."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..config.loader import DEFAULT_CONFIG, apply_overrides, load_config, merge, read_yaml
from ..config.paths import add_user_module_dirs
from ..config.schema import DEFAULTS
from ..errors import DdpxError, show_tracebacks
from ..imports import instantiate
from ..plugin.manager import make_plugin_manager, origin, raised_by
from ..rank import failures
from ..train.trainer import Trainer
from ..worker import parse_args

SMOKE_MODULE = "ddpx.smoke"
STEPS_PER_EPOCH = 2  # the data slice's: the steps below cross epoch boundaries (epoch 1's hooks run too)
TRAIN_STEPS = 3  # optimizer steps before the checkpoint: all of epoch 0, the first of epoch 1
RESUMED_STEPS = 2  # optimizer steps after the resume: the rest of epoch 1, the first of epoch 2
EVAL_SAMPLES = 64
STAGES = ("config", "setup", "train", "evaluate", "checkpoint save", "resume", "train after resume", "teardown")
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
TRACEBACK_SUFFIX = ".traceback"  # <run_dir>/smoke/rank<N>.traceback: the error that failed the rank, in full
SMOKE_TIMEOUT_S = 60  # steady-state collective timeout: a hung rank ends the smoke run quickly


# --- the data slice --------------------------------------------------------------------


def data_slice(target: str, args: dict, train_samples: int, eval_samples: int):
    """The configured data (``target(**args)``), cut to its first samples."""
    data = instantiate({"target": target, "args": args}, "data")
    train, evaluation = (data[0], data[1]) if isinstance(data, (tuple, list)) else (data, None)
    train = _head(train, train_samples)
    if evaluation is not None:
        evaluation = _head(evaluation, eval_samples)
    return train, evaluation


def _head(dataset, samples: int):
    from torch.utils.data import IterableDataset, Subset

    if isinstance(dataset, IterableDataset):
        return StreamHead(dataset, samples)
    return Subset(dataset, range(min(samples, len(dataset))))


class StreamHead(torch.utils.data.IterableDataset):
    """The first ``samples`` samples of each pass over a stream (of each part, for a stream that
    shards itself); it shards and is told the epoch as the stream is. No ``__len__``: the
    epoch ends where the head does."""

    def __init__(self, dataset, samples: int):
        self.dataset, self.samples = dataset, samples
        self.ddpx_shards_itself = getattr(dataset, "ddpx_shards_itself", False)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self):
        return itertools.islice(iter(self.dataset), self.samples)


# --- one rank ----------------------------------------------------------------------------


class StageLog:
    """This rank's stage results, written to disk after every stage (a killed
    rank still leaves what it finished)."""

    def __init__(self, path: Path, rank: int, world_size: int):
        self.path, self.rank, self.world_size = path, rank, world_size
        self.stages: list[dict] = []
        self.failed = False
        self.plugin_manager = None  # set once the config is read: names the plugin that raised

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": self.rank, "world_size": self.world_size, "stages": self.stages}))
        os.replace(tmp, self.path)

    def add(self, stage: str, status: str, detail: str = "", seconds: float = 0.0, **extra) -> None:
        self.stages.append({"stage": stage, "status": status, "detail": detail,
                            "seconds": round(seconds, 3), **extra})
        self.write()

    def skip_rest(self, reason: str) -> None:
        done = {s["stage"] for s in self.stages}
        for stage in STAGES:
            if stage not in done:
                self.stages.append({"stage": stage, "status": SKIP, "detail": reason, "seconds": 0.0})
        self.write()

    @contextlib.contextmanager
    def stage(self, name: str, detail: dict):
        """Run a stage; ``detail["text"]`` set by the body becomes the table's detail."""
        start = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            self.failed = True
            where = raised_by(self.plugin_manager, exc) if self.plugin_manager is not None else origin(exc)
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            extra = {"plugin": where[0], "hook": where[1]} if where else {}
            prefix = f"plugin '{where[0]}' raised in {where[1]}: " if where else ""
            self.add(name, FAIL, prefix + message, time.perf_counter() - start, **extra)
            raise
        self.add(name, PASS, detail.get("text", ""), time.perf_counter() - start)


def _smoke_overrides(config, world_size: int) -> list[str]:
    """Overrides that turn the user's config into the smoke run (same plugins, small data)."""
    accumulation = config.section("accumulation").get("steps", 1) if "accumulation" in config else 1
    train_samples = world_size * config.trainer.batch_size * accumulation * STEPS_PER_EPOCH
    epochs = -(-(TRAIN_STEPS + RESUMED_STEPS) // STEPS_PER_EPOCH)
    data = {"target": config.data.target, "args": config.section("data").get("args") or {},
            "train_samples": train_samples, "eval_samples": EVAL_SAMPLES}
    overrides = [
        f"data.target={__name__}.data_slice",
        f"data.args={json.dumps(data)}",
        f"trainer.epochs={epochs}",
        "trainer.eval_every_epochs=0",  # the smoke run evaluates as its own stage
        f"trainer.timeout_s={SMOKE_TIMEOUT_S}",
        f"trainer.first_timeout_s={2 * SMOKE_TIMEOUT_S}",
    ]
    if "checkpoint" in config:
        overrides += ["checkpoint.resume=false", "checkpoint.every_steps=0", "checkpoint.dir=checkpoints"]
    if "logging" in config:  # the table is the report: no bar, no epoch lines, warnings only
        overrides += ["logging.progress=false", "logging.level=warning"]
    return overrides


def load_smoke_config(config_path, overrides, extra):
    # Build the plugin manager here so even ddpx_configure failures name their plugin; the
    # user's directories first, as load_config puts them, for plugins.enable entries there.
    add_user_module_dirs(config_path)
    raw = apply_overrides(read_yaml(config_path or DEFAULT_CONFIG), [*overrides, *extra])
    pm = make_plugin_manager(merge(DEFAULTS["plugins"], raw.get("plugins") or {}))
    try:
        return load_config(config_path, [*overrides, *extra], plugin_manager=pm)
    except BaseException as exc:
        raised_by(pm, exc)  # remembered on the exception: origin(exc)
        raise


@contextlib.contextmanager
def _fresh_store_prefix(tag: str):
    """A second process group in the same processes needs its own store keys
    (ddpx.rank.process_group prefixes them with TORCHELASTIC_RESTART_COUNT)."""
    key = "TORCHELASTIC_RESTART_COUNT"
    before = os.environ.get(key)
    os.environ[key] = f"{before or '0'}-{tag}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _train_steps(trainer, until_step: int) -> str:
    start, first_epoch = trainer.global_step, trainer.epoch
    trainer.train(until_step=until_step)
    loss = trainer.last_loss.item() if trainer.last_loss is not None else float("nan")
    steps = trainer.global_step - start
    if steps == 0:  # a run that does no work is not a pass
        raise RuntimeError("0 optimizer steps: the data gave no batch (an empty data set, or sampler.drop_last "
                           "with a batch larger than the data)")
    if not math.isfinite(loss):
        raise RuntimeError(f"{steps} optimizer steps, but the last loss is {loss}: fix the model, data or "
                           "optimizer.args.lr")
    epochs = f"epoch {first_epoch}" if trainer.epoch == first_epoch else f"epochs {first_epoch}-{trainer.epoch}"
    return f"{steps} optimizer steps ({epochs}), last loss {loss:.4f}"


def run_rank(config_path: Optional[str], overrides: Sequence[str]) -> int:
    """One rank of the smoke run (inside torchrun). Returns the exit code."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # The launcher appends its run_dir after the user's: the last one wins, as in the config.
    run_dir = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("run_dir=")), None)
    if run_dir is None:
        raise DdpxError("the smoke run needs run_dir=DIR (ddpx train --smoke sets it)")
    log = StageLog(Path(run_dir) / "smoke" / f"rank{rank}.json", rank, world_size)
    running: list = [None]  # the trainer a failure must close
    try:
        _run_stages(log, running, config_path, overrides, rank, world_size)
    except BaseException as exc:
        trainer = running[0]
        if trainer is not None:
            trainer.close(exc)  # ddpx_exception for every plugin, then the teardown every run has
        # One line per rank (the table follows); the traceback goes next to the rank's record.
        failed_at = next((f" at {s['stage']}" for s in log.stages if s["status"] == FAIL), "")
        line, _ = failures.failure_line(exc, trainer.peer_failure if trainer is not None else None)
        print(f"ddpx: smoke: [rank{rank}] FAIL{failed_at}: {line}", file=sys.stderr, flush=True)
        log.path.parent.mkdir(parents=True, exist_ok=True)
        log.path.with_suffix(TRACEBACK_SUFFIX).write_text("".join(traceback.format_exception(exc)))
        if show_tracebacks():
            traceback.print_exception(exc)
        log.skip_rest("after an earlier failure")
        if not isinstance(exc, Exception):
            raise
        return 1
    return 0


def _run_stages(log: StageLog, running: list, config_path, overrides, rank: int, world_size: int) -> None:
    """Train, evaluate and save in a first trainer; resume and train on in a second one."""
    with log.stage("config", detail := {}):
        base = load_smoke_config(config_path, overrides, [])
        config = load_smoke_config(config_path, overrides, _smoke_overrides(base, world_size))
        plugins = [name for name, _ in config.plugin_manager.list_name_plugin()]
        detail["text"] = f"{len(plugins)} plugins: {', '.join(plugins)}"
    log.plugin_manager = config.plugin_manager
    checkpoints = "checkpoint" in config and config.section("checkpoint").get("enabled", False)
    if rank == 0 and checkpoints:
        _clear_checkpoints(config)  # before the first collective: no rank reads them yet

    trainer = running[0] = Trainer(config)
    with log.stage("setup", detail := {}):
        trainer.setup()
        detail["text"] = (f"{trainer.world_size} ranks, backend {trainer.backend}, "
                          f"{_samples(trainer.train_set)} train / {_samples(trainer.eval_set or [])} eval samples")
    with log.stage("train", detail := {}):
        detail["text"] = _train_steps(trainer, TRAIN_STEPS)
    with log.stage("evaluate", detail := {}):
        if trainer.eval_loader is None:
            detail["text"] = "no eval set: nothing to evaluate"
        else:
            metrics = trainer.evaluate()
            detail["text"] = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
    saved_step = trainer.global_step
    saved_weights = {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}
    if checkpoints:
        with log.stage("checkpoint save", detail := {}):
            trainer.finish()  # the checkpoint plugin saves and waits
            files = sorted(Path(trainer.run_dir, config.section("checkpoint")["dir"]).glob("*.pt"))
            if rank == 0 and not files:
                raise RuntimeError("no checkpoint file was written")
            detail["text"] = f"step {saved_step}" + (f" -> {files[-1].name}" if files else "")
    else:
        trainer.finish()
        log.add("checkpoint save", SKIP, "checkpoint plugin not loaded or disabled")
    trainer.close()
    running[0] = None
    if not checkpoints:
        for stage in ("resume", "train after resume"):
            log.add(stage, SKIP, "no checkpoint to resume from")
        log.add("teardown", PASS, "")
        return
    resume_overrides = [*_smoke_overrides(base, world_size), "checkpoint.resume=true", f"run_dir={trainer.run_dir}"]
    _resume_stages(log, running, load_smoke_config(config_path, overrides, resume_overrides), saved_step,
                   saved_weights)


def _resume_stages(log: StageLog, running: list, config, saved_step: int, saved_weights: dict) -> None:
    """A fresh trainer resumes from the first one's checkpoint: the same step and weights, then more steps."""
    log.plugin_manager = config.plugin_manager
    trainer = running[0] = Trainer(config)
    with log.stage("resume", detail := {}), _fresh_store_prefix("smoke-resume"):
        trainer.setup()  # the checkpoint plugin restores at its end (ddpx_train_start)
        if trainer.global_step != saved_step:
            raise RuntimeError(f"resumed at step {trainer.global_step}, the checkpoint was step {saved_step}")
        now = trainer.module.state_dict()
        changed = [k for k, v in saved_weights.items() if not torch.equal(now[k].cpu(), v.cpu())]
        if changed:
            raise RuntimeError(f"resumed weights differ from the saved ones: {', '.join(changed[:3])}")
        detail["text"] = f"step {saved_step}, weights identical"
    with log.stage("train after resume", detail := {}):
        detail["text"] = _train_steps(trainer, saved_step + RESUMED_STEPS)
    with log.stage("teardown", detail := {}):
        trainer.finish()
        trainer.close()


def _samples(dataset) -> str:
    from ..data.stream import has_length

    return str(len(dataset)) if has_length(dataset) else "streamed"


def _clear_checkpoints(config) -> None:
    import shutil

    directory = Path(config.section("checkpoint")["dir"])
    if not directory.is_absolute():
        directory = Path(config.run_dir) / directory
    shutil.rmtree(directory, ignore_errors=True)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_rank(args.config, args.overrides)

