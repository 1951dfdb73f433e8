"""The plugin system: discovery, blocking, validation, hook order, overrides, tracing."""

import importlib
import importlib.metadata
import os
import sys
import textwrap

import pluggy
import pytest
import torch.distributed as dist

from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.plugin import hookspecs
from ddpx.plugin.builtin import BUILTIN_PLUGINS
from ddpx.plugin.manager import make_plugin_manager, origin, plugin_table, raised_by, registered
from ddpx.train.trainer import Trainer

RECORDER = '''
import torch
from ddpx import hookimpl

calls = []    # hook names, in call order
batches = []  # (batch_index, stepped, global_step) of every ddpx_batch_end

@hookimpl
def ddpx_configure(config): calls.append("ddpx_configure")
@hookimpl
def ddpx_setup(trainer): calls.append("ddpx_setup")
@hookimpl
def ddpx_build_model(trainer):
    calls.append("ddpx_build_model")
    return torch.nn.Sequential(torch.nn.Linear(64, 10))  # overrides the trainer's default model
@hookimpl(wrapper=True)
def ddpx_wrap_model(trainer, model):
    wrapped = yield  # the strategy's wrap inside
    calls.append("ddpx_wrap_model")
    return wrapped
@hookimpl
def ddpx_model_wrapped(trainer, model): calls.append("ddpx_model_wrapped")
@hookimpl
def ddpx_build_dataloaders(trainer, train_set, eval_set): calls.append("ddpx_build_dataloaders")
@hookimpl
def ddpx_autocast(trainer): calls.append("ddpx_autocast")
@hookimpl
def ddpx_grad_scaler(trainer): calls.append("ddpx_grad_scaler")
@hookimpl
def ddpx_train_start(trainer): calls.append("ddpx_train_start")
@hookimpl
def ddpx_epoch_start(trainer, epoch): calls.append("ddpx_epoch_start")
@hookimpl
def ddpx_step_window(trainer, batch_index, num_batches): calls.append("ddpx_step_window")
@hookimpl(wrapper=True)
def ddpx_forward(trainer, batch):
    calls.append("ddpx_forward")
    return (yield)
@hookimpl
def ddpx_optimizer_step(trainer): calls.append("ddpx_optimizer_step")  # None: the trainer steps
@hookimpl
def ddpx_batch_end(trainer, batch_index, loss, stepped):
    calls.append("ddpx_batch_end")
    batches.append((batch_index, stepped, trainer.global_step))
    if trainer.config.get("fail_at") == trainer.global_step:
        raise RuntimeError("boom")
@hookimpl
def ddpx_evaluate(trainer, loader): calls.append("ddpx_evaluate")
@hookimpl
def ddpx_epoch_end(trainer, epoch, metrics): calls.append("ddpx_epoch_end")
@hookimpl
def ddpx_train_end(trainer): calls.append("ddpx_train_end")
@hookimpl
def ddpx_exception(trainer, exc): calls.append(f"exception {exc!r} {dist_alive()}")

def dist_alive():
    import torch.distributed as dist
    return dist.is_initialized()
'''


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """Write plugin modules into tmp_path (importable by name); forget them afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def make(name, source):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        importlib.invalidate_caches()
        return name

    yield make
    for name in written:
        sys.modules.pop(name, None)


def test_builtin_plugins_are_listed_in_code_and_load_without_installed_metadata(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])  # a checkout with no install record
    pm = make_plugin_manager(None)
    names = [name for name, _ in registered(pm)]
    assert names == [*BUILTIN_PLUGINS, "trainer"]  # in their listed order; trylast defaults registered last
    rows = {row["name"]: row for row in plugin_table(pm)}
    assert rows["sampler"]["distribution"] == "ddpx"
    assert "ddpx_build_dataloaders" in rows["sampler"]["hooks"]
    assert "ddpx_forward" in rows["trainer"]["hooks"] and "ddpx_step_window" in rows["accumulation"]["hooks"]


def test_a_builtin_plugin_that_cannot_load_stops_with_one_line_unless_blocked(monkeypatch):
    monkeypatch.setitem(BUILTIN_PLUGINS, "sampler", "ddpx_plugins.gone:SamplerPlugin")
    with pytest.raises(DdpxError, match=r"^built-in plugin 'sampler' 'ddpx_plugins.gone:SamplerPlugin' does not "
                                        r"resolve: .*; reinstall ddpx .* or run without it: plugins.block=\[sampler\]$"):
        make_plugin_manager(None)
    names = [name for name, _ in registered(make_plugin_manager({"block": ["sampler"]}))]
    assert "sampler" not in names and "amp" in names


class _EntryPoint:
    """An installed entry point of the group ``ddpx`` as importlib.metadata lists it."""

    def __init__(self, name, value, dist_name):
        self.name, self.value, self.module = name, value, value.partition(":")[0]
        self.dist = type("Dist", (), {"name": dist_name, "version": "1.0"})()

    def load(self):
        return importlib.import_module(self.module).__dict__[self.value.partition(":")[2]]


def test_an_entry_point_named_like_a_builtin_plugin(monkeypatch, plugin_dir):
    # an older ddpx install recorded the built-in plugins as entry points: skipped, the built-in one loads
    stale = [_EntryPoint("sampler", "ddpx_plugins.sampler:SamplerPlugin", "ddpx")]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: stale)
    assert [name for name, _ in registered(make_plugin_manager(None))] == [*BUILTIN_PLUGINS, "trainer"]
    # another package taking a built-in name: one line, not a silent choice of one of the two
    module = plugin_dir("their_sampler", "from ddpx import hookimpl\nclass Plugin:\n    pass\n")
    theirs = [_EntryPoint("sampler", f"{module}:Plugin", "their-dist")]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: theirs)
    with pytest.raises(DdpxError, match=r"^plugin 'sampler' \(entry point their_sampler:Plugin of their-dist 1.0\) "
                                        r"has the name of a built-in plugin; rename its entry point"):
        make_plugin_manager(None)


def test_block_and_enable(plugin_dir):
    plugin_dir("extra_plugin", "from ddpx import hookimpl\n@hookimpl\ndef ddpx_train_end(trainer): pass\n")
    pm = make_plugin_manager({"block": ["amp", "logging"], "enable": ["extra_plugin"]})
    names = [name for name, _ in registered(pm)]
    assert "amp" not in names and "logging" not in names and "sampler" in names
    assert names[-2:] == ["extra_plugin", "trainer"]
    with pytest.raises(DdpxError, match="'trainer' plugin \\(the default hook bodies\\) cannot be blocked"):
        make_plugin_manager({"block": ["trainer"]})


def test_unknown_hook_is_named_with_its_plugin(plugin_dir):
    plugin_dir("typo_plugin", "from ddpx import hookimpl\n@hookimpl\ndef ddpx_epoch_ends(trainer, epoch, metrics): pass\n")
    with pytest.raises(DdpxError) as info:
        make_plugin_manager({"enable": ["typo_plugin"]}, builtins=False, entry_points=False)
    assert str(info.value) == "plugin 'typo_plugin' implements unknown hook 'ddpx_epoch_ends'; did you mean 'ddpx_epoch_end'?"


def test_wrong_hook_arguments_and_import_errors(plugin_dir):
    plugin_dir("args_plugin", "from ddpx import hookimpl\n@hookimpl\ndef ddpx_epoch_end(trainer, epoch, metric): pass\n")
    with pytest.raises(DdpxError, match=r"plugin 'args_plugin' \(from plugins.enable\) is invalid: .*metric"):
        make_plugin_manager({"enable": ["args_plugin"]}, builtins=False, entry_points=False)
    plugin_dir("broken_plugin", "raise ImportError('needs libfoo')\n")
    with pytest.raises(DdpxError, match="broken_plugin.*needs libfoo"):
        make_plugin_manager({"enable": ["broken_plugin"]}, builtins=False, entry_points=False)
    with pytest.raises(DdpxError, match="plugins.enable entry 'not_a_module_xyz' does not resolve"):
        make_plugin_manager({"enable": ["not_a_module_xyz"]}, builtins=False, entry_points=False)


def run_in_process(plugin_dir, tmp_path, overrides=(), enable=()):
    name = plugin_dir("recorder", RECORDER)
    pm = make_plugin_manager({"enable": [*enable, name]}, builtins=False, entry_points=False)
    # 3 batches of 32 per epoch (96 training samples), every rank sees all data.
    config = load_config(None, ["trainer.epochs=2", "data.args.test_fraction=0.947", f"run_dir={tmp_path}/run", *overrides], plugin_manager=pm)
    return Trainer(config), sys.modules[name]


def expected_calls(windows: list, epochs: int) -> list:
    """The hook names of a run, from the order ddpx/plugin/hookspecs.py declares; ``windows``:
    the micro-batches of each optimizer step of an epoch."""
    calls = ["ddpx_configure", *hookspecs.START_HOOKS]
    for _ in range(epochs):
        calls.append("ddpx_epoch_start")
        for window in windows:
            for hook in hookspecs.STEP_HOOKS:
                calls += [hook] * (window if hook in hookspecs.MICRO_BATCH_HOOKS else 1)
        calls += hookspecs.EPOCH_END_HOOKS
    return calls + list(hookspecs.END_HOOKS)


def test_hooks_run_in_the_documented_order(plugin_dir, tmp_path):
    trainer, recorder = run_in_process(plugin_dir, tmp_path)
    trainer.run()
    assert recorder.calls == expected_calls([1, 1, 1], epochs=2)
    assert recorder.batches == [(i % 3, True, i + 1) for i in range(6)]  # (index in the epoch, stepped, step)
    # The plugin's provider result replaced the trainer's default model.
    assert isinstance(trainer.module, __import__("torch").nn.Sequential)
    assert trainer.global_step == 6 and not dist.is_initialized()  # torn down


def test_hook_order_with_accumulation_windows(plugin_dir, tmp_path):
    # 3 micro-batches per epoch in windows of 2: steps after micro-batches 2 and 3.
    trainer, recorder = run_in_process(plugin_dir, tmp_path, ["accumulation.steps=2"],
                                       enable=["ddpx_plugins.accumulation.AccumulationPlugin"])
    trainer.run()
    assert recorder.calls == expected_calls([2, 1], epochs=2)
    # batch_end after the window's step: every micro-batch sees the step done, the last one stepped
    assert recorder.batches == [(0, False, 1), (1, True, 1), (2, True, 2), (0, False, 3), (1, True, 3), (2, True, 4)]


def test_exception_reaches_plugins_and_tears_down(plugin_dir, tmp_path):
    trainer, recorder = run_in_process(plugin_dir, tmp_path)
    calls = recorder.calls
    trainer.config["fail_at"] = 2
    with pytest.raises(RuntimeError, match="boom"):
        trainer.run()
    assert calls[-1] == "exception RuntimeError('boom') True"  # told while the group still exists
    assert "ddpx_train_end" not in calls
    assert not dist.is_initialized()


def test_trace_flag_and_env_var(capsys, monkeypatch):
    load_config(None, ["plugins.trace=true"])
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "hook ddpx_configure(" in line)
    assert line.startswith("[launcher] hook ddpx_configure(config={'seed': 0,")
    called = line.rsplit("-> [", 1)[1].rstrip("]").split(", ")
    assert "amp" in called and "checkpoint" in called and "trainer" not in called  # the default hooks have no ddpx_configure
    monkeypatch.setenv("DDPX_TRACE_HOOKS", "1")
    monkeypatch.setenv("RANK", "3")
    load_config(None)
    assert "[rank3] hook ddpx_configure(config=" in capsys.readouterr().err
    monkeypatch.setenv("DDPX_TRACE_HOOKS", "0")
    load_config(None)
    assert "hook ddpx_configure" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_rank_with_different_plugins_stops_the_run(ranks, plugin_dir, tmp_path):
    # On rank 1 only, a plugin registers one more plugin: like a node with an
    # extra package installed.
    plugin_dir("odd_rank", '''
        import os
        from ddpx import hookimpl

        class Extra:
            @hookimpl
            def ddpx_train_end(self, trainer): pass

        @hookimpl
        def ddpx_configure(config):
            if os.environ.get("RANK") == "1":
                config.plugin_manager.register(Extra(), name="extra")
    ''')
    rc, out, err = ranks.cli(
        ["train", "plugins.enable=[odd_rank]", "trainer.epochs=1", f"run_dir={tmp_path}/run", "--nproc-per-node", "2"],
        timeout=120,
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
        cwd=tmp_path,
    )
    assert rc == 2
    assert "rank 1 loaded different plugins than rank 0 (position " in err
    assert "extra==-" in err
    assert err.count("loaded different plugins") == 1 and "training failed" not in err, err  # once, by one rank


# --- which plugin raised: read from the traceback, nothing wrapped ------------------------------------

spec = pluggy.HookspecMarker("t")
impl = pluggy.HookimplMarker("t")


class Spec:
    @spec
    def step(self, x):
        pass


class Inner:
    @impl
    def step(self, x):
        if x == "inner":
            raise ValueError("inner failed")
        return 1


class Wrapper:
    @impl(wrapper=True)
    def step(self, x):
        result = yield
        if x == "wrapper":
            raise KeyError("wrapper failed")
        return result


def _pm():
    pm = pluggy.PluginManager("t")
    pm.add_hookspecs(Spec)
    pm.register(Inner(), name="inner")
    pm.register(Wrapper(), name="wrap")
    return pm


def test_exceptions_carry_the_plugin_that_raised_them():
    pm = _pm()
    assert pm.hook.step(x="ok") == [1]  # behaviour unchanged, wrapper results pass through
    with pytest.raises(ValueError) as info:
        pm.hook.step(x="inner")
    assert raised_by(pm, info.value) == ("inner", "step")  # not the wrapper it passed through
    assert origin(info.value) == ("inner", "step")  # remembered on the exception
    with pytest.raises(KeyError) as info:
        pm.hook.step(x="wrapper")
    assert raised_by(pm, info.value) == ("wrap", "step")
    with pytest.raises(ZeroDivisionError) as info:
        1 / 0
    assert raised_by(pm, info.value) is None  # not from a hook


def test_every_run_names_the_plugin_that_raised(make_config):
    name = "sample_plugins.RaisesAtEpochStart"
    with pytest.raises(RuntimeError, match="broken on purpose") as info:
        Trainer(make_config("trainer.epochs=1", f"plugins.enable=[{name}]")).run()
    assert origin(info.value) == (name, "ddpx_epoch_start")  # what the worker's one line names
    if hasattr(info.value, "__notes__"):  # Python 3.11+
        assert f"(raised by plugin '{name}' in ddpx_epoch_start)" in info.value.__notes__
    assert not dist.is_initialized()


# --- pm.calls: pluggy's answers, without its dispatch where that changes nothing ------------------


class FirstSpec:
    @spec(firstresult=True)
    def pick(self, x, y):
        pass

    @spec
    def collect(self, x):
        pass


class Picks:
    def __init__(self, answer):
        self.answer = answer

    @impl
    def pick(self, x, y):
        return None if self.answer is None else (self.answer, x, y)

    @impl
    def collect(self, x):
        return self.answer


class PicksFromX:  # takes fewer arguments than the spec: pluggy drops y
    @impl
    def pick(self, x):
        return ("x only", x)


class WrapsPick:
    @impl(wrapper=True)
    def pick(self, x, y):
        result = yield
        return ("wrapped", result)


def _first_pm():
    from ddpx.plugin.manager import PluginManager

    pm = PluginManager("t")
    pm.add_hookspecs(FirstSpec)
    return pm


def test_hook_calls_answer_as_pluggy_does():
    pm = _first_pm()

    def same(name, **kwargs):
        assert getattr(pm.calls, name)(**kwargs) == getattr(pm.hook, name)(**kwargs)
        return getattr(pm.calls, name)(**kwargs)

    assert same("pick", x=1, y=2) is None  # no implementation
    pm.register(Picks("a"), name="a")
    assert same("pick", x=1, y=2) == ("a", 1, 2)  # one implementation: called directly
    assert pm.calls.pick.__func__ is Picks.pick
    assert same("collect", x=1) == ["a"]  # not firstresult: pluggy's caller, a list
    pm.register(Picks(None), name="none")  # registered later: called first, answers None
    assert same("pick", x=1, y=2) == ("a", 1, 2)
    pm.unregister(name="a")
    assert same("pick", x=1, y=2) is None
    pm.unregister(name="none")
    pm.register(PicksFromX(), name="fewer")
    assert same("pick", x=1, y=2) == ("x only", 1)  # pluggy passes only the arguments it takes
    pm.unregister(name="fewer")
    pm.register(Picks("b"), name="b")
    pm.register(WrapsPick(), name="wraps")
    assert same("pick", x=1, y=2) == ("wrapped", ("b", 1, 2))
    pm.unregister(name="wraps")
    assert pm.calls.pick.__func__ is Picks.pick  # direct again once the wrapper is gone


def test_hook_calls_are_traced_when_tracing():
    pm = _first_pm()
    pm.register(Picks("a"), name="a")
    assert pm.calls.pick(x=1, y=2) == ("a", 1, 2)
    seen = []
    undo = pm.add_hookcall_monitoring(lambda name, impls, kwargs: seen.append(name), lambda *args: None)
    assert pm.tracing
    assert pm.calls.pick(x=1, y=2) == ("a", 1, 2)
    assert seen == ["pick"]  # through pluggy, so the tracer sees it
    undo()
    assert not pm.tracing
    pm.calls.pick(x=1, y=2)
    assert seen == ["pick"]


def test_shared_state_is_keyed_by_objects_and_says_what_is_missing():
    from ddpx.plugin.shared import ACCUMULATION_STEPS, Shared, SharedKey

    shared = Shared()
    assert shared.get(ACCUMULATION_STEPS) is None and shared.get(ACCUMULATION_STEPS, 1) == 1
    shared[ACCUMULATION_STEPS] = 4
    assert ACCUMULATION_STEPS in shared and shared[ACCUMULATION_STEPS] == 4
    mine = SharedKey[int]("accumulation_steps", "a third-party key with the same name")
    assert mine not in shared  # the key object, not its name, is the key: plugins cannot collide by name
    with pytest.raises(KeyError, match="nothing shared under 'accumulation_steps' in this run "
                                       r"\(a third-party key with the same name\)"):
        shared[mine]
