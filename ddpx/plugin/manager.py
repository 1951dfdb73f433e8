"""The plugin manager: discovery, blocking, validation, tracing.

``from ddpx import hookimpl`` is what plugin authors use. Plugins come from
(in this order): the built-in plugins (:data:`ddpx.plugin.builtin.BUILTIN_PLUGINS`),
every installed distribution's entry points in the group ``ddpx``, then the dotted
module paths in ``plugins.enable``, then the trainer's default hook bodies, the plugin
named "trainer" (``trylast``, so any plugin can override them). Names in
``plugins.block`` are never loaded.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import os
import sys
import types
from typing import Any, Collection, Mapping, Optional

import pluggy

from ..errors import DdpxError
from ..imports import resolve
from ..version import __version__
from . import hookspecs
from .builtin import BUILTIN_PLUGINS
from .markers import PROJECT

ENTRY_POINT_GROUP = "ddpx"
TRAINER_PLUGIN = "trainer"
# The trainer's default hooks are loaded by their import path, like a plugins.enable
# entry: they sit above the plugin manager (they use the config and the trainer's
# helpers), so this module does not import them.
TRAINER_PLUGIN_PATH = "ddpx.train.default_hooks.DefaultHooks"
TRACE_ENV = "DDPX_TRACE_HOOKS"
ORIGIN_ATTRIBUTE = "ddpx_raised_by"  # set on an exception by raised_by()


def _plugins_section(config) -> Mapping[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping) and "enable" not in config and "plugins" in config:
        return config["plugins"] or {}
    return config


def make_plugin_manager(config=None, *, builtins: bool = True, entry_points: bool = True) -> pluggy.PluginManager:
    """A plugin manager with every hook spec and every plugin registered and checked.

    ``config`` is a :class:`~ddpx.config.Config`, its ``plugins`` section, or
    None (the built-in and installed plugins only). ``builtins=False`` and
    ``entry_points=False`` leave out the built-in and the installed plugins (tests
    that want only the trainer's default hooks and ``plugins.enable``).
    """
    section = _plugins_section(config)
    pm = PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    blocked = list(section.get("block") or [])
    if TRAINER_PLUGIN in blocked:
        raise DdpxError(f"plugins.block: the '{TRAINER_PLUGIN}' plugin (the default hook bodies) cannot be blocked; "
                        "override its hooks from a plugin instead")
    for name in blocked:
        pm.set_blocked(name)
    if builtins:
        load_builtins(pm)
    if entry_points:
        load_entry_points(pm, skip=BUILTIN_PLUGINS if builtins else {})
    for path in section.get("enable") or []:
        register_path(pm, path)
    _register(pm, resolve(TRAINER_PLUGIN_PATH, "the trainer's default hooks")(), TRAINER_PLUGIN)
    pm.distributions[TRAINER_PLUGIN] = ("ddpx", __version__)
    check_pending(pm)
    if section.get("trace") or os.environ.get(TRACE_ENV, "") not in ("", "0"):
        enable_tracing(pm)
    return pm


class PluginManager(pluggy.PluginManager):
    """pluggy's plugin manager, plus :attr:`calls`, the hooks as the trainer calls them."""

    def __init__(self, project_name: str):
        super().__init__(project_name)
        self.tracing = False  # hook calls are printed (enable_tracing)
        self.calls = HookCalls(self)
        self.distributions: dict = {}  # plugin name -> (distribution, version), where known

    def register(self, plugin, name=None):
        try:
            return super().register(plugin, name)
        finally:
            self.calls.forget()

    def unregister(self, plugin=None, name=None):
        try:
            return super().unregister(plugin, name)
        finally:
            self.calls.forget()

    def add_hookcall_monitoring(self, before, after):
        undo_monitoring = super().add_hookcall_monitoring(before, after)
        self.tracing = True
        self.calls.forget()

        def undo():
            undo_monitoring()
            self.tracing = False
            self.calls.forget()
        return undo


class HookCalls:
    """``pm.hook``, with pluggy's dispatch skipped where it changes nothing.

    pluggy costs about 2 µs a call, and a step calls three hooks (window, forward,
    optimizer step): 1.5 % of the digits example's step. A ``firstresult`` hook
    with no wrappers and at most one implementation, which takes exactly the
    spec's arguments, is that implementation itself (or ``None``'s), as plain a
    call as pluggy's answer would be. Every other hook, and every hook while
    tracing, is pluggy's caller. The choices are remade after every
    registration; callers pass the spec's arguments by keyword, as to pluggy.
    """

    def __init__(self, pm: PluginManager):
        self._pm = pm

    def __getattr__(self, name: str):  # the first use of ``name`` since forget()
        caller = getattr(self._pm.hook, name)
        call = caller if self._pm.tracing else _direct_call(caller) or caller
        setattr(self, name, call)
        return call

    def forget(self) -> None:
        self.__dict__ = {"_pm": self._pm}


def _no_result(**kwargs) -> None:
    return None


def _direct_call(caller: pluggy.HookCaller):
    """The function that answers ``caller`` as pluggy would, or None when there is no such function."""
    spec = caller.spec
    if spec is None or not spec.opts.get("firstresult") or spec.kwargdefaults or caller.is_historic():
        return None
    impls = caller.get_hookimpls()
    if not impls:
        return _no_result
    if len(impls) > 1:
        return None
    impl = impls[0]
    if impl.hookwrapper or impl.wrapper or set(impl.argnames) != set(spec.argnames):
        return None
    return impl.function


def _plugin_object(found):
    """A plugin class gives one object per plugin manager, which holds the plugin's per-run state."""
    return found() if isinstance(found, type) else found


def _register(pm: pluggy.PluginManager, plugin, name: str, origin: str = "") -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        # pluggy's message spans lines; the first only repeats the plugin name.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = "; ".join(lines[1:] or lines)
        raise DdpxError(f"plugin '{name}'{origin} is invalid: {detail} (see ddpx/plugin/hookspecs.py)") from None
    except ValueError as exc:  # already registered under another name, or name taken
        raise DdpxError(f"plugin '{name}'{origin} cannot be registered: {exc}") from None


def load_builtins(pm: PluginManager) -> None:
    """Register every built-in plugin that is not blocked. One that cannot be loaded stops
    the run: without ``sampler`` every rank would see all the data, without a word."""
    for name, path in BUILTIN_PLUGINS.items():
        if pm.is_blocked(name):
            continue
        try:
            plugin = resolve(path, f"built-in plugin '{name}'")
        except DdpxError as exc:
            raise DdpxError(f"{exc}; reinstall ddpx (pip install --no-build-isolation -e . in a checkout) "
                            f"or run without it: plugins.block=[{name}]") from None
        _register(pm, _plugin_object(plugin), name, " (built in)")
        pm.distributions[name] = ("ddpx", __version__)


def load_entry_points(pm: PluginManager, skip: Collection[str] = ()) -> None:
    """Register every installed entry point of the group ``ddpx`` (skipping blocked names, and
    the names in ``skip`` where ddpx itself declares them: an older install's record of the
    built-in plugins)."""
    seen = set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        origin = f" (entry point {ep.value} of {dist.name} {dist.version})" if dist else f" (entry point {ep.value})"
        if ep.name in skip and (dist is None or dist.name == "ddpx"):
            continue
        if ep.name in skip:
            raise DdpxError(f"plugin '{ep.name}'{origin} has the name of a built-in plugin; rename its entry point "
                            f"(or block the built-in one and yours with plugins.block=[{ep.name}])")
        if ep.name in seen or pm.is_blocked(ep.name) or pm.get_plugin(ep.name) is not None:
            continue
        seen.add(ep.name)
        try:
            plugin = _plugin_object(ep.load())  # in the try: a failing __init__ is reported like a failing import
        except ModuleNotFoundError as exc:
            if exc.name and ep.module.startswith(exc.name):
                # Stale metadata (the module was removed but the install record
                # remains): warn and go on rather than make ddpx unusable.
                print(
                    f"ddpx: warning: plugin '{ep.name}'{origin} is installed but its module is missing; "
                    f"skipped (reinstall {dist.name if dist else 'it'} or block it with plugins.block=[{ep.name}])",
                    file=sys.stderr,
                )
                continue
            raise DdpxError(f"plugin '{ep.name}'{origin} failed to import: {exc}; "
                            f"block it with plugins.block=[{ep.name}]") from None
        except Exception as exc:
            raise DdpxError(
                f"plugin '{ep.name}'{origin} failed to import: {type(exc).__name__}: {exc}; "
                f"block it with plugins.block=[{ep.name}]"
            ) from None
        _register(pm, plugin, ep.name, origin)
        if dist is not None:
            pm.distributions[ep.name] = (dist.name, dist.version)


def register_path(pm: pluggy.PluginManager, path: str) -> None:
    """Register the module (or object) at a dotted path, under that path as its name."""
    if pm.is_blocked(path) or pm.get_plugin(path) is not None:
        return
    _register(pm, _plugin_object(resolve(path, "plugins.enable entry")), path, " (from plugins.enable)")


def blocked_sections(blocked: Collection[str]) -> dict:
    """``{config section: plugin name}`` of the sections the plugins in ``plugins.block`` would
    declare (``ddpx_config_defaults``), to tell a user why such a section is unknown. Each
    blocked plugin is imported, not registered; one that cannot be read declares nothing."""
    found = {}
    entry_points = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    for name in blocked:
        found.setdefault(name, name)  # a plugin's section usually has its name
        try:
            if name in BUILTIN_PLUGINS:
                plugin = resolve(BUILTIN_PLUGINS[name], f"built-in plugin '{name}'")
            elif name in entry_points:
                plugin = entry_points[name].load()
            else:
                plugin = resolve(name, "plugins.block entry")
            declared = getattr(_plugin_object(plugin), "ddpx_config_defaults", None)
            for section in (declared() or {}) if callable(declared) else ():
                found[section] = name
        except Exception:
            continue
    return found


def check_pending(pm: pluggy.PluginManager) -> None:
    """Fail on hook implementations that match no spec (typos such as ``ddpx_epoch_ends``)."""
    known = list(hookspecs.all_hook_names())
    for name, caller in vars(pm.hook).items():
        if caller.spec is not None:
            continue
        for impl in caller.get_hookimpls():
            if impl.optionalhook:
                continue
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else "; see ddpx/plugin/hookspecs.py for the hook names"
            raise DdpxError(f"plugin '{impl.plugin_name}' implements unknown hook '{name}'{hint}")


def raised_by(pm: pluggy.PluginManager, exc: BaseException) -> Optional[tuple[str, str]]:
    """``(plugin name, hook name)`` of the innermost hook implementation ``exc`` came out of,
    or None (it came from the trainer's loop, or from outside any hook).

    Read from the traceback once the exception exists: hook calls pay nothing for it.
    Call it before per-run plugins are detached (the trainer does, for every run)."""
    origin = getattr(exc, ORIGIN_ATTRIBUTE, None)
    if origin is not None:
        return origin
    codes = hook_codes(pm)
    tb = exc.__traceback__
    while tb is not None:  # outermost first: the last match is the innermost
        origin = codes.get(tb.tb_frame.f_code, origin)
        tb = tb.tb_next
    if origin is not None:
        try:
            setattr(exc, ORIGIN_ATTRIBUTE, origin)
        except AttributeError:  # exception types with __slots__
            pass
    return origin


def hook_codes(pm: pluggy.PluginManager) -> dict:
    """``{code object: (plugin name, hook name)}`` of every hook implementation: which
    plugin a frame belongs to (an error's traceback, a collective's caller)."""
    codes: dict = {}
    for hook_name, caller in vars(pm.hook).items():
        for impl in caller.get_hookimpls() if hasattr(caller, "get_hookimpls") else ():
            code = getattr(impl.function, "__code__", None)
            if code is not None:
                codes.setdefault(code, (impl.plugin_name, hook_name))
    return codes


def plugin_code_map(pm: pluggy.PluginManager) -> tuple[dict, dict]:
    """:func:`hook_codes`, and ``{code object: (plugin name, function name)}`` of the other
    functions of plugin objects and modules (a callback scheduled with ``call_at_step``)."""
    functions: dict = {}
    for name, plugin in registered(pm):
        owner = plugin if isinstance(plugin, types.ModuleType) else type(plugin)
        for value in vars(owner).values():
            code = getattr(value, "__code__", None)
            if code is not None and getattr(value, "__module__", None) == getattr(owner, "__module__", owner.__name__):
                functions.setdefault(code, (name, value.__qualname__))
    return hook_codes(pm), functions


def origin(exc: BaseException) -> Optional[tuple[str, str]]:
    """``(plugin name, hook name)`` that :func:`raised_by` found for ``exc`` earlier, or None."""
    return getattr(exc, ORIGIN_ATTRIBUTE, None)


def rank_prefix() -> str:
    """``[rankN] `` in a worker, ``[launcher] `` in ``ddpx train`` before workers exist."""
    rank = os.environ.get("RANK")
    dist = sys.modules.get("torch.distributed")
    if rank is None and dist is not None and dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()  # a worker started without torchrun
    return f"[rank{rank}] " if rank is not None else "[launcher] "


def enable_tracing(pm: pluggy.PluginManager, write=None) -> None:
    """Print every hook call (name, arguments, implementing plugins, result) with the rank prefix."""
    write = write or (lambda line: print(line, file=sys.stderr, flush=True))
    prefix = rank_prefix()

    def brief(value):
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."

    def before(hook_name, impls, kwargs):
        args = ", ".join(f"{k}={brief(v)}" for k, v in kwargs.items() if k != "trainer")
        names = ", ".join(impl.plugin_name for impl in reversed(impls))
        write(f"{prefix}hook {hook_name}({args}) -> [{names}]")

    def after(outcome, hook_name, impls, kwargs):
        if outcome.exception is not None:
            write(f"{prefix}hook {hook_name} raised {type(outcome.exception).__name__}: {outcome.exception}")
        elif hook_name not in ("ddpx_batch_end",) and outcome.get_result() not in (None, []):
            write(f"{prefix}hook {hook_name} returned {brief(outcome.get_result())}")

    pm.add_hookcall_monitoring(before, after)


def registered(pm: pluggy.PluginManager) -> list[tuple[str, Any]]:
    """``(name, plugin)`` in registration order, without blocked names (pluggy lists those as None)."""
    return [(name, plugin) for name, plugin in pm.list_name_plugin() if plugin is not None]


def stateful_plugins(pm: pluggy.PluginManager) -> list[tuple[str, Any]]:
    """``(name, plugin)`` of the registered plugin objects whose state goes into checkpoints:
    those with ``state_dict(trainer)`` and ``load_state_dict(trainer, state)`` methods (a module's
    functions of those names do not count: module plugins use the ``ddpx_state_dict`` hook)."""
    return [(name, plugin) for name, plugin in registered(pm)
            if not isinstance(plugin, types.ModuleType) and callable(getattr(plugin, "state_dict", None))
            and callable(getattr(plugin, "load_state_dict", None))]


def plugin_table(pm: pluggy.PluginManager) -> list[dict]:
    """One row per registered plugin in registration order: name, distribution, version, hooks."""
    dists = pm.distributions
    rows = []
    for name, plugin in registered(pm):
        if name in dists:
            dist_name, version = dists[name]
        else:
            dist_name, version = _distribution_of(plugin)
        hooks = sorted(caller.name for caller in (pm.get_hookcallers(plugin) or []))
        rows.append({"name": name, "distribution": dist_name, "version": version, "hooks": hooks})
    return rows


def _distribution_of(plugin) -> tuple[str, str]:
    """Best-effort distribution of a plugin registered by dotted path."""
    module = getattr(plugin, "__module__", None) if not hasattr(plugin, "__file__") else plugin.__name__
    top = (module or "").split(".")[0]
    try:
        for dist_name in importlib.metadata.packages_distributions().get(top, []):
            return dist_name, importlib.metadata.version(dist_name)
    except Exception:
        pass
    return "-", "-"


def plugin_signature(pm: pluggy.PluginManager) -> list[str]:
    """What every rank must agree on: plugin names with versions, in registration order."""
    return [f"{row['name']}=={row['version']}" for row in plugin_table(pm)]

