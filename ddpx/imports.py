"""Objects from import paths: ``resolve("torch.optim.SGD")`` and ``instantiate(section)``.

Config targets (``model.target``), ``plugins.enable`` entries, the built-in plugins
and the trainer's default hooks are all found this way. Every failure is a one-line
:class:`~ddpx.errors.DdpxError` naming the config key.
"""

from __future__ import annotations

import importlib
from typing import Mapping

from .errors import DdpxError, did_you_mean


def resolve(path: str, key: str = "import path"):
    """Import ``package.module.attr`` (or ``package.module:attr``) and return the object."""
    if not isinstance(path, str) or not path.strip():
        raise DdpxError(f"{key} must be an import path like 'torch.optim.SGD', got {path!r}")
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    candidates = [(path.replace(":", "."), "")]  # the path may be a module itself
    if module_name:
        candidates.insert(0, (module_name, attr))
    last_error = None
    for mod, name in candidates:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            # Only "this very module is missing" means try the next reading; an
            # import error inside an existing module is the user's real problem.
            if exc.name and not mod.startswith(exc.name) and not exc.name.startswith(mod):
                raise DdpxError(f"{key} '{path}': importing {mod} failed: {exc}") from None
            last_error = exc
            continue
        except Exception as exc:  # a module that exists but fails to import
            raise DdpxError(f"{key} '{path}': importing {mod} failed: {type(exc).__name__}: {exc}") from None
        if not name:
            return module
        try:
            return getattr(module, name)
        except AttributeError:
            try:  # a submodule its package does not import (``mypkg.myplugin``)
                return importlib.import_module(f"{mod}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{mod}.{name}":
                    raise DdpxError(f"{key} '{path}': importing {mod}.{name} failed: {exc}") from None
            hint = did_you_mean(name, [n for n in dir(module) if not n.startswith("_")])
            raise DdpxError(f"{key} '{path}' does not resolve: module '{mod}' has no attribute '{name}'{hint}") from None
    top = path.replace(":", ".").split(".")[0]
    if last_error is not None and last_error.name == top:
        raise DdpxError(f"{key} '{path}' does not resolve: no module named '{top}' in {searched_dirs()}; "
                        f"put {top}.py (or the package {top}/) in one of these directories")
    raise DdpxError(f"{key} '{path}' does not resolve: {last_error}")


# The user's directories at the front of sys.path, each with what it is (ddpx/config/paths.py
# puts them there): named when a module is not found.
USER_DIRS: dict = {}


def searched_dirs() -> str:
    """Where imports look: the user's directories, then the rest of sys.path."""
    mine = [f"{d} ({what})" for d, what in USER_DIRS.items()]
    return ", ".join([*mine, "PYTHONPATH and the installed packages (sys.path)"])


def instantiate(section: Mapping, key: str, *args):
    """Call ``section.target`` with ``*args`` and ``**section.args``."""
    factory = resolve(section["target"], f"{key}.target")
    kwargs = dict(section.get("args") or {})
    try:
        return factory(*args, **kwargs)
    except (TypeError, ValueError) as exc:  # what a target says of arguments it cannot take: the config's mistake
        call = f"{section['target']}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        raise DdpxError(f"{key}: {call} failed: {type(exc).__name__}: {exc}; fix {key}.args") from exc
