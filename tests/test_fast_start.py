"""What needs no torch starts without it: ``ddpx --help`` (and every command's), ``ddpx plugins``
and the config errors that ``read_config`` finds before any import path is resolved
(ddpx/config/loader.py). Torch takes about a second to import, these take a tenth of that.

Each test imports ddpx afresh in this process with torch made unimportable
(``sys.modules["torch"] = None``), runs the command, and puts every module back: an
``import torch`` anywhere on the way is an ImportError that names the importing line.
"""

import contextlib
import sys

import pytest

from ddpx.config.strategies import BUILTIN_STRATEGIES, strategy_class, strategy_import_path


@contextlib.contextmanager
def fresh_ddpx_without_torch():
    """``ddpx.cli.main`` of a ddpx imported afresh, with ``import torch`` failing."""
    saved_modules, saved_path = dict(sys.modules), list(sys.path)
    for name in list(sys.modules):
        if name.partition(".")[0] in ("ddpx", "ddpx_plugins", "torch"):
            del sys.modules[name]
    sys.modules["torch"] = None
    try:
        from ddpx.cli import main

        yield main
    finally:
        sys.modules.clear()
        sys.modules.update(saved_modules)
        sys.path[:] = saved_path


def run(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's --help
        return exc.code


def test_the_help_of_every_command_imports_no_torch(capsys):
    with fresh_ddpx_without_torch() as main:
        for argv in (["--help"], ["train", "--help"], ["plugins", "--help"], ["doctor", "--help"],
                     ["bench", "--help"], ["bench", "comm", "--help"], ["bench", "kernels", "--help"]):
            assert run(main, argv) == 0, argv
            assert "usage: ddpx" in capsys.readouterr().out


def test_the_plugins_listing_imports_no_torch(capsys):
    with fresh_ddpx_without_torch() as main:
        assert run(main, ["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["sampler", "amp", "accumulation", "comm_hook", "logging",
                                                         "checkpoint", "comm_monitor", "early_stopping", "ema",
                                                         "profiler", "trainer"]
    assert "ddpx_forward" in lines[-2]
    assert lines[-1].startswith("strategy: ddp (ddpx.strategies.ddp.DDPStrategy); built in: ddp, fsdp, pipeline, tensor")


@pytest.mark.parametrize("override, message", [
    ("trainr.epochs=2", "unknown key 'trainr' in the config; did you mean 'trainer'?"),
    ("trainer.epochs=abc", "config key 'trainer.epochs' must be an integer, got 'abc' (str)"),
    ("trainer.batch_size=0", "config key 'trainer.batch_size' must be >= 1"),
    ("trainer.strategy=fdsp", "unknown trainer.strategy 'fdsp'; did you mean 'fsdp'?"),
    ("comm_hook.nme=int8", "unknown key 'comm_hook.nme' in section 'comm_hook'; did you mean 'comm_hook.name'?"),
    ("checkpoint.keep=first", "config key 'checkpoint.keep' must be an integer, got 'first' (str)"),
])
def test_config_errors_before_any_import_path_import_no_torch(override, message, capsys):
    with fresh_ddpx_without_torch() as main:
        assert run(main, ["train", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ddpx: error: {message}") and err.count("\n") == 1, err


def test_what_is_said_of_the_builtin_strategies_unimported_holds():
    """read_config leaves them (and torch) unimported: their section, fsdp, is ddpx's own; ``ddpx
    plugins`` names their classes by import path."""
    for name in BUILTIN_STRATEGIES:
        cls = strategy_class(name)
        assert cls.config_defaults == {}
        assert strategy_import_path(name) == f"{cls.__module__}.{cls.__qualname__}"
