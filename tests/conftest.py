"""What every test module shares: one config builder (``make_config``) and one way to
start processes (``ranks``, from tests/harness.py).

Lanes: ``python -m pytest -q -m "not slow" tests`` is the fast lane for development
(no test in it starts a process; a test that does without the ``slow`` mark fails);
``python -m pytest -q tests`` runs everything, as CI does.
"""

import threading

import pytest
import pytest_timeout

import harness
from ddpx.config import load_config
from ddpx.plugin.manager import make_plugin_manager


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(items):
    """A test that uses ``ranks`` (itself or through a fixture) starts processes: it is slow."""
    for item in items:
        if "ranks" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    harness.current_test = item  # before the test's fixtures, which may start processes too


def pytest_runtest_teardown(item):
    harness.current_test = None


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """Each test's limit (pyproject.toml's ``timeout``, a ``pytest.mark.timeout``) on the tests'
    clock (``harness.clock``), not the wall's: a hang still ends the run with every thread's
    stack, a busy machine does not."""
    if settings.method != "thread":
        return None  # pytest-timeout's own signal timer
    cancelled = threading.Event()
    deadline = harness.clock() + settings.timeout

    def watch():
        while not cancelled.wait(0.5):  # returns at once when the test ends
            if harness.clock() >= deadline:
                pytest_timeout.timeout_timer(item, settings)

    watcher = threading.Thread(target=watch, name=f"timeout {item.nodeid}", daemon=True)
    item.cancel_timeout = lambda: (cancelled.set(), watcher.join())
    watcher.start()
    return True


@pytest.fixture(scope="session")
def ranks():
    """Start processes: ``ranks.cli(args)`` (``python -m ddpx``), ``ranks.call(fn, world_size)``
    (a function on gloo ranks), ``ranks.train(run_dir, config_path, world_size, timeout)``
    (``ddpx.worker`` ranks without torchrun), ``ranks.commands(cmds, logdir, timeout)``
    (several commands at once), ``ranks.two_hosts()`` (network namespaces). The test
    must be marked ``slow``."""
    return harness.Ranks()


@pytest.fixture
def two_hosts(request, ranks):
    """Two hosts in network namespaces joined by a veth pair (root only):
    ``[(namespace, interface, address)] * 2``. Parametrize it indirectly with a tc rate
    (``"100mbit"``) to shape the link."""
    with ranks.two_hosts(rate=getattr(request, "param", None)) as hosts:
        yield hosts


@pytest.fixture
def make_config(tmp_path):
    """``make_config(*overrides, run_dir=None, defaults_only=False)``: a small, quiet config
    (``run_dir`` under tmp_path, a 16-unit MLP, no progress bar) with ``overrides`` on
    top; ``defaults_only``: the trainer's default hooks alone (no built-in or installed plugins:
    no sampler, AMP, ...)."""

    def build(*overrides, run_dir=None, defaults_only=False, plugin_manager=None):
        base = [f"run_dir={run_dir or tmp_path / 'run'}", "model.args.hidden=16"]
        if defaults_only:
            plugin_manager = make_plugin_manager(None, builtins=False, entry_points=False)
        elif plugin_manager is None:
            base.append("logging.progress=false")
        return load_config(None, [*base, *overrides], plugin_manager=plugin_manager)

    return build
