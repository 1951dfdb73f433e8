"""ddpx's own config sections: their defaults, the types and choices of their keys, and the
numeric ranges checked before any worker starts. Plugins add sections of their own through
``ddpx_config_defaults`` (see :mod:`.loader`).

The type of a default is the type the key must have (``int`` accepts nothing else but
ints, ``float`` accepts ints); ``None`` defaults accept anything; a default of ``{}`` is a
free-form mapping (e.g. ``optimizer.args``), a non-empty mapping is validated key by key.
"""

from __future__ import annotations

import re
from typing import Mapping

from ..errors import DdpxError

DEFAULTS: dict = {
    "seed": 0,
    "run_dir": None,
    "model": {"target": "ddpx.models.DigitsMLP", "args": {"hidden": 128}},
    "data": {"target": "ddpx.data.digits_split", "args": {"test_fraction": 0.2, "seed": 0}, "collate": None},
    "loss": {"target": "torch.nn.CrossEntropyLoss", "args": {}},
    "optimizer": {"target": "torch.optim.SGD", "args": {"lr": 0.1, "momentum": 0.9}},
    "scheduler": {"target": None, "args": {}},
    "trainer": {
        "epochs": 10,
        "batch_size": 32,
        "eval_batch_size": 256,
        "grad_clip": None,
        "backend": "auto",
        "device": "auto",
        "find_unused_parameters": False,
        "static_graph": False,
        "bucket_cap_mb": None,
        "gradient_as_bucket_view": None,
        "num_workers": 0,
        "max_steps": None,
        "eval_every_epochs": 1,
        "timeout_s": 300,
        "first_timeout_s": 900,
        "check_collectives": True,
        "stall_s": 10,
        "nonfinite": "stop",
        "eval_metric": None,
        "sync_batchnorm": False,
        "compile": False,
        "seed_per_sample": False,
        "compile_dynamic": "batch",
        "strategy": "ddp",
    },
    "fsdp": {"units": "auto", "min_unit_params": 100_000, "reshard_after_forward": True, "reduce_dtype": "fp32",
             "param_dtype": "amp", "shard_size": "all", "offload": "none"},
    "pipeline": {"stages": 2, "schedule": "1f1b", "microbatches": 4, "stages_per_rank": 1, "split": "auto",
                 "data_parallel": "ddp"},
    "tensor": {"size": 2, "plan": "auto"},
    "launch": {"nproc_per_node": "auto", "nnodes": "1", "max_restarts": 0},
    # restart: a failure restarts every worker from the last checkpoint (torchrun). live: each node
    # is a replica group that the others train on without (torchft, ddpx/recovery/).
    "elastic": {"recovery": "restart", "lighthouse": None, "min_groups": 1, "timeout_s": 30.0,
                "quorum_timeout_s": 60.0, "lighthouse_retries": 30},
    "plugins": {"enable": [], "block": [], "trace": False},
}

# Keys whose type is not the type of their default (nullable numbers, "auto"-or-int).
TYPES: dict = {
    "seed": (int,),
    "run_dir": (str, type(None)),
    "loss.target": (str, type(None)),
    "scheduler.target": (str, type(None)),
    "data.collate": (str, type(None)),
    "trainer.eval_metric": (str, type(None)),
    "trainer.compile": (bool, str),
    "trainer.grad_clip": (float, type(None)),
    "trainer.bucket_cap_mb": (float, type(None)),
    "trainer.gradient_as_bucket_view": (bool, type(None)),
    "trainer.max_steps": (int, type(None)),
    "trainer.timeout_s": (float,),
    "trainer.first_timeout_s": (float,),
    "trainer.stall_s": (float,),
    "launch.nproc_per_node": (int, str),
    "launch.nnodes": (int, str),
    "trainer.strategy": (str,),
    "fsdp.units": (str, list),
    "fsdp.shard_size": (str, int),
    "pipeline.split": (str, list),
    "tensor.plan": (str, dict),
    "elastic.lighthouse": (str, type(None)),
    "elastic.timeout_s": (float,),
    "elastic.quorum_timeout_s": (float,),
}
CHOICES: dict = {
    "trainer.backend": ("auto", "gloo", "nccl", "mpi", "ucc"),
    "trainer.nonfinite": ("stop", "warn"),
    "trainer.compile_dynamic": ("batch", "auto", "static", "all"),
    "fsdp.reduce_dtype": ("fp32", "bf16", "fp16"),
    "fsdp.param_dtype": ("amp", "fp32"),
    "fsdp.offload": ("none", "cpu"),
    "pipeline.schedule": ("1f1b", "gpipe", "interleaved_1f1b"),
    "pipeline.data_parallel": ("ddp", "fsdp"),
    "elastic.recovery": ("restart", "live"),
}
# Sections built from an import path; their ``args`` are free-form keyword arguments that
# belong to their target: where a target is given (in the file over the defaults, on the
# command line over the file) the args are those given with it, else {}; args given without
# a target merge into those below (loader.target_args).
TARGET_SECTIONS = ("model", "data", "loss", "optimizer", "scheduler")
FREE_FORM = frozenset(f"{section}.args" for section in TARGET_SECTIONS)


# Numeric ranges of ddpx's own keys: (lowest allowed, whether the lowest itself is allowed, hint).
RANGES: dict = {
    "trainer.epochs": (1, True, "the number of passes over the data"),
    "trainer.batch_size": (1, True, "samples per rank and step"),
    "trainer.eval_batch_size": (1, True, "samples per rank and evaluation batch"),
    "trainer.max_steps": (1, True, "null for no limit"),
    "trainer.num_workers": (0, True, "0 loads in the training process"),
    "trainer.eval_every_epochs": (0, True, "0 never evaluates"),
    "trainer.grad_clip": (0, False, "null for no clipping"),
    "trainer.bucket_cap_mb": (0, False, "null for DDP's default"),
    "trainer.timeout_s": (0, False, "seconds"),
    "trainer.first_timeout_s": (0, False, "seconds"),
    "trainer.stall_s": (0, False, "seconds a rank may wait in one collective before the ranks compare notes"),
    "launch.max_restarts": (0, True, "0 for none"),
    "pipeline.stages": (1, True, "ranks per pipeline, one stage each"),
    "pipeline.microbatches": (1, True, "micro-batches each batch is split into"),
    "pipeline.stages_per_rank": (1, True, "stages each rank holds (interleaved_1f1b: 2 or more)"),
    "tensor.size": (1, True, "ranks each layer is split over"),
    "elastic.min_groups": (1, True, "replica groups a step needs to commit"),
    "elastic.timeout_s": (0, False, "seconds a collective across replica groups may take"),
    "elastic.quorum_timeout_s": (0, False, "seconds a step waits for the Lighthouse's quorum"),
    "elastic.lighthouse_retries": (0, True, "quorum attempts while the Lighthouse is away"),
    "fsdp.min_unit_params": (1, True, "parameters a module needs to become an FSDP unit under fsdp.units=auto"),
}


def check_ranges(values: Mapping) -> None:
    """One-line errors for numbers out of range (``trainer.batch_size=0``), for a
    ``launch.nproc_per_node`` / ``launch.nnodes`` that torchrun would reject, and
    for an ``fsdp`` section that cannot work (:func:`check_fsdp`)."""
    for path, (low, inclusive, hint) in RANGES.items():
        section, key = path.split(".")
        value = values.get(section, {}).get(key)
        if value is None or isinstance(value, bool):
            continue
        if value < low or (value == low and not inclusive):
            bound = f">= {low}" if inclusive else f"> {low}"
            raise DdpxError(f"config key '{path}' must be {bound} ({hint}), got {value}")
    launch = values.get("launch", {})
    check_nproc(launch.get("nproc_per_node"), "launch.nproc_per_node")
    nnodes = str(launch.get("nnodes"))
    if not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", nnodes):
        raise DdpxError(f"config key 'launch.nnodes' must be a number of nodes >= 1 or MIN:MAX, got {nnodes!r}")
    check_fsdp(values)


def check_fsdp(values: Mapping) -> None:
    """``fsdp.units`` and ``fsdp.shard_size`` (the built-in fsdp strategy's section, ddpx/strategies/fsdp.py)."""
    units = values.get("fsdp", {}).get("units", "auto")
    if isinstance(units, str) and units != "auto":
        raise DdpxError(f"config key 'fsdp.units' must be auto or a list of module class names (e.g. [Block]), "
                        f"got {units!r}")
    if isinstance(units, list) and (not units or not all(isinstance(u, str) and u for u in units)):
        raise DdpxError(f"config key 'fsdp.units' must be auto or a non-empty list of module class names, got {units!r}")
    shard = values.get("fsdp", {}).get("shard_size", "all")
    if isinstance(shard, bool) or (isinstance(shard, str) and shard not in ("all", "node")) or \
            (isinstance(shard, int) and shard < 1):
        raise DdpxError(f"config key 'fsdp.shard_size' must be all, node or a number of ranks >= 1 (the ranks each "
                        f"parameter is sharded over; HSDP below the world size), got {shard!r}")


NPROC_WORDS = ("auto", "gpu", "cpu")  # torchrun's words for --nproc-per-node (a Kubeflow TrainJob passes them)


def check_nproc(value, where: str) -> None:
    """A whole number >= 1 (also as a string from the command line) or one of :data:`NPROC_WORDS`."""
    if value is None or value in NPROC_WORDS:
        return
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise DdpxError(f"{where} must be a number of processes >= 1, auto, gpu or cpu, got {value!r}")
