"""Config loading, overrides and validation: the promised one-line errors."""

import textwrap

import pytest
from ddpx.net import free_port

from ddpx.config import load_config, read_config
from ddpx.config.loader import DEFAULT_CONFIG, apply_overrides, parse_value, read_yaml
from ddpx.config.schema import TARGET_SECTIONS
from ddpx.errors import DdpxError
from ddpx.launch.preflight import check_target_arguments
from ddpx.launch.rendezvous import check_rendezvous
from ddpx.plugin.manager import make_plugin_manager


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(*args, **kwargs) -> str:
    with pytest.raises(DdpxError) as info:
        load_config(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_default_config_values_and_types():
    config = load_config()
    assert config.model.target == "ddpx.models.DigitsMLP"
    assert config.trainer.epochs == 10 and config.trainer.batch_size == 32
    assert config.section("trainer")["backend"] == "auto"
    # plugin sections come from the built-in plugins' ddpx_config_defaults
    assert config.section("accumulation") == {"steps": 1}
    assert config.amp.enabled is False
    assert isinstance(config.trainer.timeout_s, float)  # an int default given for a float key


def test_overrides_are_yaml_scalars():
    assert parse_value("3") == 3
    assert parse_value("1e-3") == 0.001  # PyYAML alone would give the string "1e-3"
    assert parse_value("-2.5E+2") == -250.0
    assert parse_value("[a, b]") == ["a", "b"]
    assert parse_value("true") is True
    assert parse_value("null") is None
    assert parse_value("hello") == "hello"
    config = load_config(None, ["trainer.epochs=3", "optimizer.args.lr=5e-2", "plugins.block=[amp]", "seed=7"])
    assert config.trainer.epochs == 3
    assert config.optimizer.args == {"lr": 0.05, "momentum": 0.9}
    assert config.seed == 7
    assert "amp" not in config  # the blocked plugin's section is gone
    assert config.plugin_manager.get_plugin("amp") is None


def test_yaml_file_merges_over_defaults_and_target_resets_args(tmp_path):
    path = write(tmp_path, """
        trainer: {epochs: 2, grad_clip: 1}
        optimizer: {target: torch.optim.Adam}
        model: {args: {hidden: 16}}
    """)
    config = load_config(path)
    assert config.trainer.epochs == 2 and config.trainer.batch_size == 32
    assert config.trainer.grad_clip == 1.0 and isinstance(config.trainer.grad_clip, float)
    # A new optimizer does not inherit SGD's momentum; model args replace as a whole.
    assert config.optimizer.target == "torch.optim.Adam" and config.optimizer.args == {}
    assert config.model.target == "ddpx.models.DigitsMLP" and config.model.args == {"hidden": 16}
    assert config.source == path


@pytest.mark.parametrize("section", TARGET_SECTIONS)
def test_a_command_line_target_brings_its_own_args_over_the_files(tmp_path, section):
    """The rule of the file over the defaults, again for the command line over the file (read_config
    resolves no target, so any name does)."""
    path = write(tmp_path, f"{section}: {{target: pkg.FileTarget, args: {{a: 1, b: 2}}}}\n")
    args = lambda *overrides: read_config(path, overrides)[section]["args"]  # noqa: E731
    assert args() == {"a": 1, "b": 2}
    assert args(f"{section}.target=pkg.Other") == {}  # another target: none of the file's args
    assert args(f"{section}.target=pkg.Other", f"{section}.args.c=3") == {"c": 3}
    assert args(f"{section}.target=pkg.FileTarget") == {}  # a target given is a target with the args given
    assert args(f"{section}.args.b=5", f"{section}.args.c=3") == {"a": 1, "b": 5, "c": 3}  # no target: merged
    assert args(f"{section}={{target: pkg.Other}}") == {}


def test_a_command_line_optimizer_takes_none_of_the_files_arguments(tmp_path):
    """An AdamW config tried with Rprop: the file's weight_decay, which Rprop does not take, stays out."""
    path = write(tmp_path, "optimizer: {target: torch.optim.AdamW, args: {lr: 0.001, weight_decay: 0.01}}\n")
    config = load_config(path, ["optimizer.target=torch.optim.Rprop"])
    assert config.optimizer.args == {}
    check_target_arguments(config)  # what refused weight_decay before a worker started


def test_unknown_keys_suggest_the_closest():
    assert error_of(None, ["trainer.epoch=3"]) == "unknown key 'trainer.epoch' in section 'trainer'; did you mean 'trainer.epochs'?"
    assert "did you mean 'accumulation'" in error_of(None, ["acumulation.steps=2"])
    assert "did you mean 'amp.enabled'" in error_of(None, ["amp.enable=true"])
    message = error_of(None, ["zzz=1"])
    assert message.startswith("unknown key 'zzz' in the config; valid keys:") and "trainer" in message


def test_wrong_types():
    assert error_of(None, ["trainer.epochs=ten"]) == "config key 'trainer.epochs' must be an integer, got 'ten' (str)"
    assert "must be true or false" in error_of(None, ["amp.enabled=3"])
    assert "must be a number or null" in error_of(None, ["trainer.grad_clip=big"])
    assert "must be a mapping" in error_of(None, ["optimizer.args=5"])
    assert "must be a list" in error_of(None, ["plugins.enable=foo"])
    assert "must be one of auto, gloo" in error_of(None, ["trainer.backend=tcp"])
    assert "must be an integer" in error_of(None, ["trainer.epochs=true"])  # bool is not an int here


def test_missing_and_broken_files(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    assert error_of(missing) == f"config file '{missing}' not found; pass an existing YAML file or none for the built-in default"
    broken = write(tmp_path, "trainer: {epochs: 2\nmodel: x\n")
    assert "is not valid YAML" in error_of(broken) and "line" in error_of(broken)
    assert "must hold a mapping" in error_of(write(tmp_path, "- 1\n- 2\n", "list.yaml"))


def test_import_paths_must_resolve():
    assert error_of(None, ["optimizer.target=torch.optim.SGDD"]) == (
        "optimizer.target 'torch.optim.SGDD' does not resolve: module 'torch.optim' has no attribute 'SGDD'; did you mean 'SGD'?"
    )
    message = error_of(None, ["model.target=no_such_package.Net"])
    assert message.startswith("model.target 'no_such_package.Net' does not resolve") and "no_such_package" in message
    assert "scheduler.target" in error_of(None, ["scheduler.target=torch.optim.lr_scheduler.NoSuch"])


def test_bad_override_syntax():
    with pytest.raises(DdpxError, match="must look like KEY=VALUE"):
        apply_overrides({}, ["trainer.epochs"])
    with pytest.raises(DdpxError, match="'seed' is not a section"):
        apply_overrides({"seed": 1}, ["seed.x=1"])


def test_plugin_sections_are_validated(tmp_path, monkeypatch):
    (tmp_path / "myplugin.py").write_text(textwrap.dedent("""
        from ddpx import hookimpl
        @hookimpl
        def ddpx_config_defaults():
            return {"myplugin": {"level": 3, "ratio": 0.5, "name": "x", "extra": {}}}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = make_plugin_manager({"enable": ["myplugin"]}, builtins=False, entry_points=False)
    config = load_config(None, ["myplugin.ratio=2", "myplugin.extra.anything=1"], plugin_manager=pm)
    assert config.section("myplugin") == {"level": 3, "ratio": 2.0, "name": "x", "extra": {"anything": 1}}
    assert "did you mean 'myplugin.level'" in error_of(None, ["myplugin.levle=2"], plugin_manager=pm)
    assert "must be an integer" in error_of(None, ["myplugin.level=2.5"], plugin_manager=pm)


def test_default_yaml_is_complete():
    # The shipped default names every one of ddpx's own sections explicitly (users copy it).
    assert {"model", "data", "loss", "optimizer", "scheduler", "trainer"} <= set(read_yaml(DEFAULT_CONFIG))


def test_unreachable_rendezvous_endpoint(monkeypatch):
    import ddpx.launch.options

    from ddpx.net import Route

    port = free_port()  # nothing listens there; pretend 127.0.0.1 is another host
    route = Route("127.0.0.1", port, "127.0.0.1", local=False, local_addr="127.0.0.1", iface="lo")
    with pytest.raises(DdpxError, match=rf"^node 127.0.0.1: rendezvous endpoint 127.0.0.1:{port} is unreachable"):
        check_rendezvous(route, wait_s=1.0)
    with pytest.raises(DdpxError, match="must be HOST:PORT"):
        ddpx.launch.options.parse_endpoint("127.0.0.1")


@pytest.mark.slow
def test_cli_errors_are_one_line_without_traceback(ranks, tmp_path):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cases = [
        (["train", "trainer.epoch=3"], "ddpx: error: unknown key 'trainer.epoch' in section 'trainer'; did you mean 'trainer.epochs'?"),
        (["train", str(tmp_path / "missing.yaml")], "ddpx: error: config file '"),
        (["train", "--master-port", str(port)], f"ddpx: error: master port {port} on 127.0.0.1 is busy"),
    ]
    try:
        for args, expected in cases:
            rc, out, err = ranks.cli(args, timeout=60, cwd=tmp_path)
            assert rc == 2, (args, out, err)
            assert err.startswith(expected), (args, err)
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    finally:
        busy.close()
    assert not (tmp_path / "runs").exists()  # nothing was launched
