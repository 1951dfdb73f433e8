"""``ddpx export RUN_DIR``: a run's model from its checkpoint, as the files a run writes at its end.

The model is built from the run's config (the one ``ddpx train`` recorded in the run
directory, or ``--config``), on the CPU; the checkpoint's weights are read into it (a
replicated checkpoint's ``model`` entry, or the shard directory each rank wrote under a
sharded strategy, at any world size), and ``ddpx.rank.model_files.write_model`` writes
them: ``model.safetensors`` (with ``config.json`` for a HuggingFace model)."""

import json
import sys
import warnings
from pathlib import Path

from ..config import split_config_and_overrides
from ..errors import DdpxError


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
    p.add_argument("--out", metavar="DIR", help="where to write (default: RUN_DIR/model)")
    p.add_argument("--config", metavar="YAML",
                   help="the run's config, where RUN_DIR has no record of it (a run not started by ddpx train)")
    p.set_defaults(func=run, overrides_anywhere=True)  # KEY=VALUE also after the options (ddpx/cli/__init__.py)


def run(args):
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise DdpxError(f"ddpx export {run_dir}: no such run directory; pass the run_dir of a run")
    config = run_config(run_dir, args.config, args.overrides)
    path, checkpoint = read_checkpoint(config, run_dir, args.checkpoint)
    model = model_from(config, path, checkpoint)
    from ..rank.model_files import MODEL_DIR, write_model

    out = Path(args.out) if args.out else run_dir / MODEL_DIR
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    written, why = write_model(state, out, model)
    note = f" (not safetensors: {why})" if why else ""
    print(f"ddpx: wrote {out}: {', '.join(written)} from {path} (step {checkpoint.get('step')}){note}",
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
    from ..rank.checkpoint_files import CheckpointDirectory, load_file

    if path is not None:
        try:
            return Path(path), load_file(Path(path))
        except Exception as exc:
            raise DdpxError(f"cannot read checkpoint {path}: {exc}") from None
    directory = Path(config.section("checkpoint").get("dir") or "checkpoints")
    directory = directory if directory.is_absolute() else run_dir / directory
    found = CheckpointDirectory(directory).load_latest()
    if found is None:
        raise DdpxError(f"no checkpoint in {directory}; give one with --checkpoint PATH (a run with "
                        f"checkpoint.enabled=false wrote its model into {run_dir / 'model'} at its end only)")
    return found


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
