"""YAML configuration: defaults, file, ``key=value`` overrides, validation.

The valid keys are the core sections below plus every section a plugin declares
through ``ddpx_config_defaults()``. The type of a default is the type the key
must have (``int`` also accepts nothing else but ints, ``float`` accepts ints);
``None`` defaults accept anything; a default of ``{}`` is a free-form mapping
(e.g. ``optimizer.args``), a non-empty mapping is validated key by key.
Every problem is a one-line :class:`~ddpx.errors.DdpxError`.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from typing import Any, Iterable, Mapping, Optional

import yaml

from .errors import DdpxError, did_you_mean
from .imports import instantiate, resolve  # noqa: F401  (ddpx.config.resolve: the old home)
from .plugin import make_plugin_manager

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "default.yaml")

CORE_DEFAULTS: dict = {
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
        "nonfinite": "stop",
        "eval_metric": None,
        "sync_batchnorm": False,
        "compile": False,
        "seed_per_sample": False,
        "compile_dynamic": "batch",
    },
    "launch": {"nproc_per_node": "auto", "nnodes": "1", "max_restarts": 0},
    "plugins": {"enable": [], "block": [], "trace": False},
}

# Keys whose type is not the type of their default (nullable numbers, "auto"-or-int).
CORE_TYPES: dict = {
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
    "launch.nproc_per_node": (int, str),
    "launch.nnodes": (int, str),
}
CHOICES: dict = {
    "trainer.backend": ("auto", "gloo", "nccl", "mpi", "ucc"),
    "trainer.nonfinite": ("stop", "warn"),
    "trainer.compile_dynamic": ("batch", "auto", "static", "all"),
}
# Sections built from an import path; their ``args`` are free-form keyword
# arguments: given with a target they replace the default's as a whole, and are
# reset to {} when only the target is given (SGD's momentum must not leak into a
# user's Adam); given without one they merge into the default's.
TARGET_SECTIONS = ("model", "data", "loss", "optimizer", "scheduler")

_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    list: "a list",
    dict: "a mapping",
    type(None): "null",
}

# PyYAML (YAML 1.1) reads `1e-3` as a string; every user means the float.
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def parse_value(text: str) -> Any:
    """A command-line value as a YAML scalar (``3`` -> 3, ``1e-3`` -> 0.001, ``[a]`` -> list)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


class Section(dict):
    """A mapping whose keys are also attributes (``config.trainer.epochs``)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r}") from None

    def __deepcopy__(self, memo):
        return type(self)(copy.deepcopy(dict(self), memo))


def _sections(value):
    if isinstance(value, Mapping):
        return Section({k: _sections(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_sections(v) for v in value]
    return value


class Config(Section):
    """The validated configuration: ``config.trainer.epochs``, ``config.section("amp")``.

    ``config.source`` is the file it was read from (None for the built-in
    default) and ``config.overrides`` the ``key=value`` strings applied on top,
    so workers can rebuild exactly the same config.
    """

    source: Optional[str] = None
    overrides: tuple = ()

    def section(self, name: str) -> dict:
        """A plain-dict copy of one section (``{}`` if absent)."""
        return to_plain(self.get(name, {}))

    def to_dict(self) -> dict:
        return to_plain(self)


def to_plain(value):
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value


# --- reading ---------------------------------------------------------------------------


def read_yaml(path: str) -> dict:
    if not os.path.exists(path):
        raise DdpxError(f"config file '{path}' not found; pass an existing YAML file or none for the built-in default")
    if os.path.isdir(path):
        raise DdpxError(f"config path '{path}' is a directory; pass a YAML file")
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise DdpxError(f"config file '{path}' is not valid YAML ({problem} at{where})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DdpxError(f"config file '{path}' must hold a mapping of sections, got {type(data).__name__}")
    return data


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """Apply ``a.b.c=value`` strings to a nested dict (in place; returns it)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise DdpxError(f"override '{item}' must look like KEY=VALUE, e.g. trainer.epochs=3")
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise DdpxError(f"override '{item}': '{prefix}' is not a section (it is {child!r})")
            node = child
        node[parts[-1]] = parse_value(text)
    return data


def merge(base: dict, update: Mapping, free_form=frozenset(), prefix: str = "") -> dict:
    """Recursive dict merge: mappings merge key by key, everything else (and
    the ``free_form`` dotted paths) replaces."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(out.get(key), dict) and out[key] and path not in free_form:
            out[key] = merge(out[key], value, free_form, f"{path}.")
        else:
            out[key] = copy.deepcopy(value)
    return out


FREE_FORM = frozenset(f"{section}.args" for section in TARGET_SECTIONS)


# --- validation ------------------------------------------------------------------------


def _type_ok(value, types) -> bool:
    for t in types:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t not in (int, float) and isinstance(value, t):
            return True
    return False


def _validate(values: dict, defaults: Mapping, types: Mapping, prefix: str = "") -> None:
    """Unknown keys, wrong types and bad choices, recursively (free-form mappings unchecked)."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        if key not in defaults:
            where = f"section '{prefix[:-1]}'" if prefix else "the config"
            hint = did_you_mean(key, defaults, prefix)
            if not hint:
                hint = f"; valid keys: {', '.join(sorted(map(str, defaults)))}"
            raise DdpxError(f"unknown key '{path}' in {where}{hint}")
        default = defaults[key]
        expected = types.get(path)
        if expected is None:
            if default is None:
                continue
            expected = (float,) if isinstance(default, float) else (type(default),)
            if isinstance(default, Mapping):
                expected = (dict,)
        if not _type_ok(value, expected):
            names = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in expected)
            raise DdpxError(f"config key '{path}' must be {names}, got {value!r} ({type(value).__name__})")
        if path in CHOICES and value not in CHOICES[path]:
            raise DdpxError(f"config key '{path}' must be one of {', '.join(CHOICES[path])}, got {value!r}")
        if isinstance(default, Mapping) and default and path not in FREE_FORM:
            _validate(value, default, types, prefix=f"{path}.")


# Numeric ranges of core keys: (lowest allowed, whether the lowest itself is allowed, hint).
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
    "launch.max_restarts": (0, True, "0 for none"),
}


def check_ranges(values: Mapping) -> None:
    """One-line errors for numbers out of range (``trainer.batch_size=0``), and for a
    ``launch.nproc_per_node`` / ``launch.nnodes`` that torchrun would reject."""
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


def check_nproc(value, where: str) -> None:
    """``auto`` or a whole number >= 1 (also as a string from the command line)."""
    if value is None or value == "auto":
        return
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise DdpxError(f"{where} must be a number of processes >= 1 or auto, got {value!r}")


def _coerce_floats(values: dict, defaults: Mapping, types: Mapping, prefix: str = "") -> None:
    """Store ints given for float keys as floats, so plugins see the declared type."""
    for key, value in values.items():
        default = defaults.get(key)
        path = f"{prefix}{key}"
        declared = types.get(path, (type(default),))
        if isinstance(value, int) and not isinstance(value, bool) and float in declared and int not in declared:
            values[key] = float(value)
        elif isinstance(value, dict) and isinstance(default, Mapping) and default and path not in FREE_FORM:
            _coerce_floats(value, default, types, prefix=f"{path}.")


def default_run_dir() -> str:
    """``runs/<UTC timestamp>`` under the current directory, absolute. ``ddpx train``
    picks it once per launch, so torchrun's restarts resume in the same place."""
    import datetime

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.abspath(os.path.join("runs", stamp))


def user_module_dirs(config_path: Optional[str]) -> list[str]:
    """Where a run finds the user's own modules (``model.target: mymodel.Net``), first
    first: the config file's directory, then the current directory (which
    ``python -m`` puts first too). Both come before ``PYTHONPATH`` and the
    installed packages."""
    dirs = [os.path.dirname(os.path.abspath(config_path))] if config_path is not None else []
    return list(dict.fromkeys([*dirs, os.getcwd()]))


def add_user_module_dirs(config_path: Optional[str]) -> None:
    """Put :func:`user_module_dirs` at the front of ``sys.path`` (once)."""
    for directory in reversed(user_module_dirs(config_path)):
        if directory not in sys.path:
            sys.path.insert(0, directory)


# --- the entry point -------------------------------------------------------------------


def plugin_defaults(pm) -> dict:
    """Sections declared by the registered plugins (``ddpx_config_defaults``)."""
    out: dict = {}
    for impl in reversed(pm.hook.ddpx_config_defaults.get_hookimpls()):  # registration order
        declared = impl.function()
        if not declared:
            continue
        for section, values in declared.items():
            if section in CORE_DEFAULTS:
                raise DdpxError(f"plugin '{impl.plugin_name}' declares config section '{section}', which is a core section")
            if section in out:
                raise DdpxError(f"plugin '{impl.plugin_name}' declares config section '{section}', already declared by another plugin")
            out[section] = copy.deepcopy(dict(values))
    return out


def load_config(path: Optional[str] = None, overrides: Iterable[str] = (), plugin_manager=None) -> Config:
    """Read, override, validate and announce (``ddpx_configure``) a config.

    ``path`` None means the built-in default (``ddpx/configs/default.yaml``).
    Without ``plugin_manager`` one is made from the config's ``plugins``
    section (entry points + ``plugins.enable`` - ``plugins.block``); it is
    available afterwards as ``config.plugin_manager``.
    """
    overrides = tuple(overrides)
    raw = read_yaml(path if path is not None else DEFAULT_CONFIG)
    add_user_module_dirs(path)
    raw = apply_overrides(raw, overrides)

    # The plugins section decides which plugins exist, so it is validated first.
    plugins_raw = raw.get("plugins") or {}
    _validate({"plugins": plugins_raw}, CORE_DEFAULTS, CORE_TYPES)
    plugins_section = merge(CORE_DEFAULTS["plugins"], plugins_raw)
    pm = plugin_manager if plugin_manager is not None else make_plugin_manager(plugins_section)

    defaults = merge(CORE_DEFAULTS, plugin_defaults(pm))
    _validate(raw, defaults, CORE_TYPES)
    values = merge(defaults, raw, FREE_FORM)
    for section in TARGET_SECTIONS:
        given = raw.get(section) or {}
        if "target" in given and "args" not in given:
            values[section]["args"] = {}
        elif "target" not in given and isinstance(given.get("args"), Mapping):
            # `optimizer.args.lr=0.05` on a config without a target: into the default's args (SGD keeps momentum)
            values[section]["args"] = {**defaults[section]["args"], **given["args"]}
        if values[section]["target"] is not None:
            resolve(values[section]["target"], f"{section}.target")
    if values["data"]["collate"] is not None:
        resolve(values["data"]["collate"], "data.collate")
    if values["trainer"]["eval_metric"] is not None:
        resolve(values["trainer"]["eval_metric"], "trainer.eval_metric")
    _coerce_floats(values, defaults, CORE_TYPES)
    check_ranges(values)

    config = Config(_sections(values))
    config.source = path
    config.overrides = overrides
    config.plugin_manager = pm
    pm.hook.ddpx_configure(config=config)
    return config
