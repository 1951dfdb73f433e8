"""Reading a config: the YAML file (or the built-in ``default.yaml``), ``key=value``
overrides, the plugins' sections, validation, and :func:`load_config`, which does all of it.

The valid keys are ddpx's own sections (:mod:`.schema`) plus every section a plugin
declares through ``ddpx_config_defaults()``. Every problem is a one-line
:class:`~ddpx.errors.DdpxError`.

Two steps, cheapest first: :func:`read_config` checks the config against what declares its
keys (ddpx's own sections before any plugin is loaded, then the plugins' and the strategy's
sections) and imports none of the run's code, so an error there comes before torch is
imported (the built-in plugins import it only where they use it; tests/test_fast_start.py);
:func:`load_config` then resolves the import paths (``model.target``, ...) and asks the
strategy and the plugins (``ddpx_configure``).
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any, Iterable, Mapping, Optional, Union

import yaml

from ..errors import DdpxError, did_you_mean
from ..imports import resolve
from ..plugin.manager import blocked_sections, make_plugin_manager
from .paths import add_user_module_dirs
from .schema import CHOICES, DEFAULTS, FREE_FORM, TARGET_SECTIONS, TYPES, check_ranges
from .strategies import check_strategy_name, run_strategy_class, strategy_sections

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "default.yaml")


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



# --- the entry point -------------------------------------------------------------------


def plugin_defaults(pm, strategy=None) -> dict:
    """Sections declared by the registered plugins (``ddpx_config_defaults``) and by the run's
    ``strategy`` (its class's ``config_defaults``)."""
    declared = [(f"plugin '{impl.plugin_name}'", impl.function())
                for impl in reversed(pm.hook.ddpx_config_defaults.get_hookimpls())]  # registration order
    if strategy is not None:
        declared.append((f"strategy '{strategy}'", strategy_sections(strategy)))
    out: dict = {}
    for who, sections in declared:
        for section, values in (sections or {}).items():
            if section in DEFAULTS:
                raise DdpxError(f"{who} declares config section '{section}', one of ddpx's own sections")
            if section in out:
                raise DdpxError(f"{who} declares config section '{section}', already declared by another plugin")
            out[section] = copy.deepcopy(dict(values))
    return out


def read_config(path: Union[str, Mapping, None] = None, overrides: Iterable[str] = (), plugin_manager=None) -> Config:
    """Read, override and check a config against what declares its keys, importing none of the
    run's code: the import paths (``model.target``, ...) are not resolved and no plugin's
    ``ddpx_configure`` runs (:func:`load_config` does both). ``ddpx plugins`` needs no more.

    ``path`` None means the built-in default (``ddpx/config/default.yaml``); a mapping is taken
    as a YAML file's contents (``ddpx.fit`` passes either). Without ``plugin_manager`` one is
    made from the config's ``plugins`` section (entry points + ``plugins.enable`` -
    ``plugins.block``); it is ``config.plugin_manager`` afterwards.
    """
    overrides = tuple(overrides)
    if isinstance(path, Mapping):
        file_values, path = copy.deepcopy(dict(path)), None
    else:
        file_values = read_yaml(path if path is not None else DEFAULT_CONFIG)
    add_user_module_dirs(path)
    raw = apply_overrides(copy.deepcopy(file_values), overrides)

    # ddpx's own sections first (the plugins section decides which plugins exist): their
    # errors, a misspelt strategy among them, need no plugin loaded.
    _validate({key: value for key, value in raw.items() if key in DEFAULTS}, DEFAULTS, TYPES)
    check_ranges(merge(DEFAULTS, raw, FREE_FORM))
    strategy = raw.get("trainer", {}).get("strategy", DEFAULTS["trainer"]["strategy"])
    check_strategy_name(strategy)
    plugins_section = merge(DEFAULTS["plugins"], raw.get("plugins") or {})
    pm = plugin_manager if plugin_manager is not None else make_plugin_manager(plugins_section)

    defaults = merge(DEFAULTS, plugin_defaults(pm, strategy))
    check_blocked_sections(raw, defaults, plugins_section["block"])
    _validate(raw, defaults, TYPES)
    values = merge(defaults, raw, FREE_FORM)
    command_line = apply_overrides({}, overrides)
    for section in TARGET_SECTIONS:
        values[section]["args"] = target_args([defaults[section], file_values.get(section),
                                               command_line.get(section)])
    _coerce_floats(values, defaults, TYPES)

    config = Config(_sections(values))
    config.source = path
    config.overrides = overrides
    config.plugin_manager = pm
    return config


def target_args(layers: Iterable) -> dict:
    """The ``args`` of a target section from its layers, bottom first (ddpx's default, the
    file's, the command line's): a layer that names a ``target`` brings its own args (``{}``
    when it gives none: SGD's momentum must not reach a user's Adam, nor a file's
    ``weight_decay`` a command-line Rprop); args given without a target merge into those below."""
    args: dict = {}
    for layer in layers:
        if not isinstance(layer, Mapping):
            continue
        given = layer.get("args")
        if "target" in layer:
            args = dict(given) if isinstance(given, Mapping) else {}
        elif isinstance(given, Mapping):
            args = {**args, **given}
    return args


def load_config(path: Union[str, Mapping, None] = None, overrides: Iterable[str] = (), plugin_manager=None) -> Config:
    """Read and check (:func:`read_config`), resolve the import paths, and have the strategy and
    the plugins check the result (``ddpx_configure``): the validated config a run uses."""
    config = read_config(path, overrides, plugin_manager)
    for section in TARGET_SECTIONS:
        if config[section]["target"] is not None:
            resolve(config[section]["target"], f"{section}.target")
    if config.data.collate is not None:
        resolve(config.data.collate, "data.collate")
    if config.trainer.eval_metric is not None:
        resolve(config.trainer.eval_metric, "trainer.eval_metric")
    run_strategy_class(config).check_config(config.to_dict())
    config.plugin_manager.hook.ddpx_configure(config=config)
    return config


def check_blocked_sections(raw: Mapping, defaults: Mapping, blocked) -> None:
    """A section of a plugin that ``plugins.block`` blocks is not just an unknown key: say whose it is."""
    unknown = [key for key in raw if key not in defaults]
    if not unknown or not blocked:
        return
    owners = blocked_sections(blocked)
    for key in unknown:
        if key in owners:
            raise DdpxError(f"config section '{key}' belongs to the plugin '{owners[key]}', which plugins.block "
                            f"blocks; remove the section, or take '{owners[key]}' out of plugins.block")


def split_config_and_overrides(config: Optional[str], overrides: Iterable[str]) -> tuple[Optional[str], list[str]]:
    """A command's positional arguments: ``ddpx train trainer.epochs=3`` means the default
    config and one override."""
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        return None, [config, *overrides]
    for item in overrides:
        if "=" not in item:
            raise DdpxError(f"unexpected argument '{item}': after the config file only KEY=VALUE overrides may follow")
    return config, list(overrides)
