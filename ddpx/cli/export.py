"""``ddpx export RUN_DIR``: a run's model from its checkpoint, as the files a run writes at its end.

The model is built from the run's config (the one ``ddpx train`` recorded in the run
directory, or ``--config``), on the CPU; the checkpoint's weights are read into it (a
replicated checkpoint's ``model`` entry, or the shard directory each rank wrote under a
sharded strategy, at any world size), and ``ddpx.rank.model_files.write_model`` writes
them: ``model.safetensors`` (with ``config.json`` for a HuggingFace model). ``--ema`` writes
the EMA weights instead, those the ``ema`` plugin wrote at the run's end (``ema_weights.pt``),
into ``RUN_DIR/model-ema``."""

import json
import sys
import warnings
from pathlib import Path

from ..config import split_config_and_overrides
from ..errors import DdpxError

EMA_MODEL_DIR = "model-ema"  # in run_dir: ddpx export --ema's default --out


def register(subparsers):
    p = subparsers.add_parser(
        "export",
        help="write a run's model from a checkpoint as model.safetensors (a from_pretrained directory for a "
             "HuggingFace model), to load without ddpx",
        description="Build the run's model from its config, read a checkpoint's weights into it (the newest by "
                    "default; a sharded one at any world size) and write them as a run writes them at its end: "
                    "OUT/model.safetensors, with config.json for a HuggingFace model.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (its checkpoints and its launch record)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides on top of the run's (e.g. a model argument the run was given)")
    p.add_argument("--checkpoint", metavar="PATH", help="a step-N.pt of the run (default: the newest that loads)")
    p.add_argument("--out", metavar="DIR", help=f"where to write (default: RUN_DIR/model, with --ema RUN_DIR/{EMA_MODEL_DIR})")
    p.add_argument("--ema", action="store_true",
                   help="the EMA weights the run wrote at its end (RUN_DIR/ema_weights.pt, with ema.decay) instead "
                        "of a checkpoint's raw weights")
    p.add_argument("--config", metavar="YAML",
                   help="the run's config, where RUN_DIR has no record of it (a run not started by ddpx train)")
    p.set_defaults(func=run, overrides_anywhere=True)  # KEY=VALUE also after the options (ddpx/cli/__init__.py)


def run(args):
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise DdpxError(f"ddpx export {run_dir}: no such run directory; pass the run_dir of a run")
    if args.ema and args.checkpoint:
        raise DdpxError("ddpx export --ema writes the EMA weights of the run's end (RUN_DIR/ema_weights.pt), not a "
                        "checkpoint's: leave --checkpoint out")
    config = run_config(run_dir, args.config, args.overrides)
    path, checkpoint = read_ema(run_dir) if args.ema else read_checkpoint(config, run_dir, args.checkpoint)
    model = model_from(config, path, checkpoint)
    from ..rank.model_files import MODEL_DIR, write_model

    out = Path(args.out) if args.out else run_dir / (EMA_MODEL_DIR if args.ema else MODEL_DIR)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    written, why = write_model(state, out, model)
    note = f" (not safetensors: {why})" if why else ""
    what = "the EMA weights of step" if args.ema else "step"
    print(f"ddpx: wrote {out}: {', '.join(written)} from {path} ({what} {checkpoint.get('step')}){note}",
          file=sys.stderr)
    return 0


def run_config(run_dir: Path, config_path, overrides):
    """The run's config: ``config_path`` with ``overrides``, else the config and overrides
    ``ddpx train`` recorded in ``run_dir`` followed by ``overrides``; ``run_dir`` set to it."""
    from ..config import load_config
    from ..launch.resume import LAUNCH_RECORD

    if config_path is None:
        try:
            record = json.loads((run_dir / LAUNCH_RECORD).read_text())
        except (OSError, ValueError):
            raise DdpxError(f"{run_dir} has no readable {LAUNCH_RECORD} (ddpx train writes it), so its config is "
                            "unknown; give it: ddpx export RUN_DIR --config YAML [KEY=VALUE ...]") from None
        config_path, overrides = record.get("config"), [*record.get("overrides", []), *overrides]
        if config_path is not None and not Path(config_path).is_file():
            raise DdpxError(f"the run's config {config_path} is gone; give it: ddpx export {run_dir} --config YAML")
    config_path, overrides = split_config_and_overrides(config_path, overrides)
    return load_config(config_path, [*overrides, f"run_dir={run_dir}"])


def read_checkpoint(config, run_dir: Path, path) -> tuple:
    """``(path, checkpoint)``: the file ``path`` names, else the newest that loads in the run's
    checkpoint directory (``checkpoint.dir``)."""
    from ..rank.checkpoint_files import FORMAT_KEY, CheckpointDirectory, NotACheckpoint, load_file

    directory = Path(config.section("checkpoint").get("dir") or "checkpoints")
    directory = directory if directory.is_absolute() else run_dir / directory
    if path is not None:
        instead = f"give a step-N.pt of {directory}, or leave --checkpoint out for the newest"
        try:
            checkpoint = load_file(Path(path))
        except FileNotFoundError:
            raise DdpxError(f"--checkpoint {path}: no such file; {instead}") from None
        except NotACheckpoint as exc:
            raise DdpxError(f"--checkpoint {exc}; {instead}") from None
        except Exception as exc:
            raise DdpxError(f"cannot read checkpoint {path}: {exc}") from None
        if isinstance(checkpoint, dict) and checkpoint.get("weights") == "ema":
            raise DdpxError(f"--checkpoint {path} holds the EMA weights of a run's end, not a checkpoint: "
                            f"ddpx export {run_dir} --ema writes them")
        if not isinstance(checkpoint, dict) or FORMAT_KEY not in checkpoint:
            raise DdpxError(f"--checkpoint {path} is not a ddpx checkpoint (a file torch.save wrote, without "
                            f"{FORMAT_KEY}); {instead}")
        return Path(path), checkpoint
    found = CheckpointDirectory(directory).load_latest()
    if found is None:
        raise DdpxError(f"no checkpoint in {directory}; give one with --checkpoint PATH (a run with "
                        f"checkpoint.enabled=false wrote its model into {run_dir / 'model'} at its end only)")
    return found


def read_ema(run_dir: Path) -> tuple:
    """``(path, checkpoint)`` for the EMA weights the ``ema`` plugin wrote at the run's end,
    as a checkpoint whose replicated model entry they are."""
    from ..rank.checkpoint_files import NotACheckpoint, load_file

    path = run_dir / "ema_weights.pt"  # plugins/ddpx_plugins/ema.py's EXPORT
    if not path.is_file():
        raise DdpxError(f"{path} does not exist: a run with ema.decay set writes it when its training ends "
                        f"(the checkpoints hold the raw weights: ddpx export {run_dir} without --ema)")
    try:
        export = load_file(path)
    except NotACheckpoint as exc:
        raise DdpxError(f"{path} is not ddpx's EMA weights ({exc.what})") from None
    if not isinstance(export, dict) or export.get("weights") != "ema" or "state_dict" not in export:
        raise DdpxError(f"{path} does not hold ddpx's EMA weights (a dict with weights: ema and a state_dict)")
    return path, {"step": export.get("step"), "replicated": {"model": export["state_dict"]}}


def model_from(config, path: Path, checkpoint: dict):
    """The run's model (``model.target`` on the CPU) with the checkpoint's weights: its replicated
    ``model`` entry, or its shard directory read through the run's strategy."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ..imports import instantiate
    from ..rank.checkpoint_files import SHARDS_KEY
    from ..rank.model_files import tied_names
    from ..strategies import make

    model = instantiate(config.model, "model")
    shards = checkpoint.get(SHARDS_KEY)
    try:
        if shards is not None:  # each tied tensor once: the model's own tensors are filled in place
            template = {k: v for k, v in model.state_dict().items() if k not in tied_names(model)}
            with warnings.catch_warnings():  # DCP's note that it reads in one process: what export does
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                read = make(config).read_shards({"model": template}, path.parent / shards)
            if "model" not in read:
                raise DdpxError(f"the shard directory of {path} holds no model entry")
        elif "model" in checkpoint.get("replicated", {}):
            model.load_state_dict(checkpoint["replicated"]["model"])
        else:
            raise DdpxError(f"checkpoint {path} holds no model (trainer.strategy={checkpoint.get('strategy')})")
    except (RuntimeError, ValueError, CheckpointException) as exc:
        failures = getattr(exc, "failures", None)  # DCP's, by rank: (the reader's own error, its stack)
        detail = " ".join(str(next(iter(failures.values()))[0] if failures else exc).split())
        detail = detail if len(detail) <= 200 else detail[:197] + "..."
        raise DdpxError(f"checkpoint {path} holds another model's weights than {config.model['target']} builds "
                        f"({detail}); export with the config the run was trained with") from None
    return model
