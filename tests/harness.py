"""The one way the tests start processes (through the ``ranks`` fixture of conftest.py).

One core, :func:`start` and :func:`finish`: every process writes its output to a
file (an undrained pipe would block a rank mid-collective), runs in a session of
its own, and is killed with every process it started when the deadline passes
(each Python process first prints its threads' stacks) or, optionally, when a
peer fails; the test then fails with what each process printed.
On it stand the four shapes the tests need:

* :func:`run` and :func:`run_cli`: one command, ``python -m ddpx ARGS`` for the latter
  (torchrun starts the workers);
* :func:`run_commands`: several commands at once (two torchrun "nodes", hosts in
  network namespaces);
* :func:`call_ranks`: a test function in ``world_size`` fresh processes joined by a
  gloo group (``python harness.py`` below is one rank);
* :func:`train_ranks`: ``ddpx.worker`` ranks started without torchrun, as srun or
  mpirun start them.

Plus simulated hosts in network namespaces (root only): :func:`two_hosts` (a veth pair) and
:func:`hosts` (n hosts on a switch).

Every time limit in the tests is counted on one clock, :func:`clock`: seconds of a
CPU's time as a process waiting for one gets it, so a limit catches a hang without
measuring how busy the machine is (docs/testing.md, "Time limits").
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import datetime
import importlib
import importlib.util
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from ddpx.net import free_port  # noqa: F401  (the tests' free ports)

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# --- the tests' clock: a CPU's seconds, not the wall's -------------------------------------------

class _Clock:
    """Seconds that advance as the monotonic clock does on a machine with a CPU free for every
    runnable task, and slower when more tasks want one than there are CPUs: by the share of a
    CPU each then gets, CPUs / runnable tasks (``procs_running`` of /proc/stat, sampled every
    ``PERIOD`` s by a thread), never slower than ``SLOWEST`` (a hang still ends, at worst 10
    times its limit later). Without /proc/stat: the monotonic clock."""

    PERIOD = 0.1
    SLOWEST = 0.1

    def __init__(self):
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.lock = threading.Lock()
        self.at, self.value, self.rate = time.monotonic(), 0.0, 1.0
        self.history = collections.deque(maxlen=36_000)  # (time.time(), value): an hour of samples
        if self._runnable() is not None:
            threading.Thread(target=self._sample, name="harness clock", daemon=True).start()

    @staticmethod
    def _runnable():
        with contextlib.suppress(OSError, ValueError):
            with open("/proc/stat", "rb") as f:
                stat = f.read()
            at = stat.index(b"\nprocs_running ") + 15
            return int(stat[at:stat.index(b"\n", at)]) - 1  # not counting this thread, which reads
        return None

    def _sample(self):
        while True:
            runnable = self._runnable() or 0
            rate = max(self.SLOWEST, min(1.0, self.cpus / max(1, runnable)))
            with self.lock:
                now = time.monotonic()
                self.value += (now - self.at) * self.rate
                self.at, self.rate = now, rate
                self.history.append((time.time(), self.value))
            time.sleep(self.PERIOD)

    def now(self) -> float:
        with self.lock:
            return self.value + (time.monotonic() - self.at) * self.rate

    def at_wall_time(self, wall: float) -> float:
        """The clock's reading at ``wall`` (a ``time.time()`` another process wrote), to the sample
        before it; before the first sample, as if the clock had run with the wall's."""
        with self.lock:
            i = bisect.bisect_right(self.history, (wall, float("inf")))
            first_wall, first = self.history[0] if self.history else (time.time(), self.value)
            return self.history[i - 1][1] if i else first - max(0.0, first_wall - wall)


_clock = None


def clock() -> float:
    """The tests' clock: seconds of a CPU's time as a runnable process gets it (see _Clock).
    On an idle machine it runs with the wall clock; at 11 runnable tasks on 2 CPUs, at 2/11
    of it. Every time limit in the tests is on this clock: a hang is still caught, a busy
    machine is not taken for one."""
    global _clock
    if _clock is None:
        _clock = _Clock()
    return _clock.now()


def since(wall: float) -> float:
    """Seconds on :func:`clock` since ``wall``, a ``time.time()`` (a file's mtime, a timestamp
    a process under test wrote): from the event under test, not from a process's start."""
    clock()
    return _clock.now() - _clock.at_wall_time(wall)


def _limit(seconds: float, started: float) -> str:
    """A limit that ran out, for a failure message: on the tests' clock, and the wall's."""
    return f"{seconds:.0f} s (the tests' clock; {time.monotonic() - started:.0f} s of wall clock)"


def wait_for(condition, seconds: float, poll: float = 0.05):
    """Call ``condition`` until it returns something true or ``seconds`` pass on :func:`clock`;
    return its last value (false: the time ran out)."""
    deadline = clock() + seconds
    while not (value := condition()) and clock() < deadline:
        time.sleep(poll)
    return value


def base_env(env=None) -> dict:
    """The current environment, one thread per process (2 cores, several ranks), Python's
    fault handler on (a crash, or a hang :func:`finish` ends, prints every thread's stack),
    ``env`` on top (a None value unsets a variable)."""
    full = dict(os.environ)
    full.setdefault("OMP_NUM_THREADS", "1")
    full.setdefault("PYTHONFAULTHANDLER", "1")
    full.update(env or {})
    return {k: v for k, v in full.items() if v is not None}


@dataclasses.dataclass
class Finished:
    """One process's end: exit code (None: killed at the deadline), its output
    (stdout, with stderr unless that went to a file of its own: ``errors``)."""

    returncode: int | None
    output: str
    hung: bool
    errors: str = ""


def _err_log(log) -> Path:
    return Path(log).with_suffix(".err")


def start(cmd, log: Path, env: dict, cwd=None, split_stderr: bool = False) -> subprocess.Popen:
    """Start ``cmd`` in a new session, stdout to ``log`` and stderr too (``split_stderr``:
    to ``log`` with the suffix ``.err``)."""
    require_slow_mark()
    with open(log, "w") as out, open(_err_log(log) if split_stderr else os.devnull, "w") as err:
        return subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=err if split_stderr else subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True, preexec_fn=_no_core_files)


def _no_core_files() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the SIGABRT of a hang's stack dump writes none
    for signum in (signal.SIGINT, signal.SIGHUP):  # as in a terminal, also where the suite itself runs
        signal.signal(signum, signal.SIG_DFL)  # in the background or under nohup (both ignored there)


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process descended from it: torchrun starts its workers in sessions
    of their own, out of reach of the launcher's process group."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(stat.read_text().rpartition(")")[2].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def _dump_and_kill(pids: list[int]) -> None:
    """Each Python process prints every thread's stack into the log (SIGABRT, with
    PYTHONFAULTHANDLER), so the test's failure shows where it hung; then SIGKILL. All are
    frozen first (no agent reacts to a worker's end) and dump one at a time (the logs are
    shared)."""
    def signal_each(pids, *signals, pause=0.0):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                for sig in signals:
                    os.kill(pid, sig)
                time.sleep(pause)

    signal_each(pids, signal.SIGSTOP)
    signal_each(reversed(pids), signal.SIGABRT, signal.SIGCONT, pause=0.5)
    signal_each(pids, signal.SIGKILL)


def finish(procs, logs, timeout: float, stop_on_failure: bool = False) -> list[Finished]:
    """Wait for every process until ``timeout`` s pass (or, with ``stop_on_failure``, until
    one exits non-zero: its peers would wait for it until the gloo timeout); kill what is
    left, process group and all."""
    def ended():
        running = [p.poll() is None for p in procs]
        return not any(running) or (stop_on_failure and any(p.returncode not in (None, 0) for p in procs))

    wait_for(ended, timeout)
    hung = [p.poll() is None for p in procs]
    _dump_and_kill([pid for p, still_running in zip(procs, hung) if still_running for pid in process_tree(p.pid)])
    for p, still_running in zip(procs, hung):
        if still_running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
        p.wait()
    errors = [_err_log(log).read_text(errors="replace") if _err_log(log).exists() else "" for log in logs]
    return [Finished(None if h else p.returncode, Path(log).read_text(errors="replace"), h, e)
            for p, log, h, e in zip(procs, logs, hung, errors)]


def run_commands(cmds, logdir: Path, timeout: float, env=None, cwd=None, names=None,
                 split_stderr: bool = False) -> list[Finished]:
    """Run several commands at once (e.g. two torchrun nodes) and return how each ended;
    ``env``: one mapping for all, or a list with one per command."""
    names = names or [f"proc{i}" for i in range(len(cmds))]
    logs = [Path(logdir) / f"{name}.log" for name in names]
    envs = env if isinstance(env, list) else [env] * len(cmds)
    procs = [start(cmd, log, base_env(e), cwd, split_stderr) for cmd, log, e in zip(cmds, logs, envs)]
    return finish(procs, logs, timeout)


def run(cmd, timeout=120, env=None, cwd=None) -> tuple[int, str, str]:
    """Run ``cmd`` and return ``(returncode, stdout, stderr)``. The test fails with the output so
    far when ``timeout`` seconds pass on :func:`clock` (the command is killed with every process
    it started)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        (ended,) = run_commands([cmd], Path(tmp), timeout, env, cwd, ["cmd"], split_stderr=True)
    if ended.hung:
        raise AssertionError(f"`{' '.join(map(str, cmd))}` did not finish within {_limit(timeout, started)}\n"
                             f"--- stdout ---\n{ended.output[-4000:]}\n--- stderr ---\n{ended.errors[-4000:]}")
    return ended.returncode, ended.output, ended.errors


def run_cli(args, timeout=120, env=None, cwd=None, python=None, script=None):
    """:func:`run` of ``python -m ddpx ARGS`` (``script``: an installed ``ddpx`` script, as a user
    types it; ``python``: another interpreter): ``(returncode, stdout, stderr)``."""
    cmd = [script] if script else [python or sys.executable, "-m", "ddpx"]
    return run([*cmd, *args], timeout, env, cwd)


def finish_or_fail(procs, logs, timeout: float) -> list[Finished]:
    """:func:`finish` (stopping at the first failure); the test fails with every failed
    or killed rank's output."""
    started = time.monotonic()
    ended = finish(procs, logs, timeout, stop_on_failure=True)
    failed = [rank for rank, e in enumerate(ended) if not e.hung and e.returncode != 0]
    lines = []
    for rank, e in enumerate(ended):
        if e.hung and failed:
            lines.append(f"rank {rank} was killed when rank {failed[0]} failed:\n{e.output[-3000:]}")
        elif e.hung:
            lines.append(f"rank {rank} did not finish within {_limit(timeout, started)} (killed):\n{e.output[-3000:]}")
        elif e.returncode != 0:
            lines.append(f"rank {rank} exited with {e.returncode}:\n{e.output[-3000:]}")
    if lines:
        raise AssertionError("\n".join(lines))
    return ended


def call_ranks(fn, world_size: int = 2, args: tuple = (), timeout: float = 90.0) -> list:
    """``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined by a gloo group
    on a free loopback port; returns the ranks' return values (passed back with torch.save)."""
    import torch

    module_path = sys.modules[fn.__module__].__file__
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        args_file = os.path.join(tmp, "args.pt")
        torch.save(args, args_file)
        logs = [Path(tmp) / f"rank{rank}.log" for rank in range(world_size)]
        env = base_env({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        procs = [start([sys.executable, __file__, module_path, fn.__name__, rank, world_size, port, args_file,
                        os.path.join(tmp, f"rank{rank}.pt"), timeout], log, env)
                 for rank, log in enumerate(logs)]
        finish_or_fail(procs, logs, timeout)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def train_ranks(run_dir: Path, config_path: Path, world_size: int, timeout: float, agent_store: bool = True,
                env=None) -> list[str]:
    """Start ``world_size`` ``ddpx.worker`` ranks on ``config_path`` without torchrun; return
    each rank's output. ``agent_store``: this process serves the rendezvous store, as
    torchrun's agent does; otherwise rank 0 serves it (srun, mpirun)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if agent_store else None
    common = dict(
        {k: v for k, v in base_env(env).items() if not k.startswith("TORCHELASTIC_")},
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port if agent_store else free_port()),
        TORCHELASTIC_USE_AGENT_STORE=str(agent_store),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    logs = [Path(run_dir).parent / f"rank{rank}.log" for rank in range(world_size)]
    procs = [start([sys.executable, "-m", "ddpx.worker", "--config", config_path], log,
                   dict(common, RANK=str(rank), LOCAL_RANK=str(rank)), cwd=Path(run_dir).parent)
             for rank, log in enumerate(logs)]
    return [e.output for e in finish_or_fail(procs, logs, timeout)]


def _rank_main(argv: list[str]) -> None:
    """One rank of :func:`call_ranks`."""
    import torch
    import torch.distributed as dist

    from ddpx.collector import freeze_what_is_alive
    from ddpx.rank import process_group

    module_path, fn_name, rank, world, port, args_file, out_file, timeout = argv
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("_ddpx_test_module", module_path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(module_path))
    spec.loader.exec_module(module)
    freeze_what_is_alive()  # as a ddpx rank does: torch's objects left out of every collection
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(timeout)))
    try:
        result = getattr(module, fn_name)(rank, world, *torch.load(args_file, weights_only=False))
        torch.save(result, out_file)
        del result
    finally:
        process_group.teardown()  # the DDP models and hook states the function left go first
    # The result is saved; skip interpreter teardown, the other place that abort hits.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- hosts in network namespaces (root only) -------------------------------------------------


def benchmark(name: str):
    """The module ``benchmarks/<name>.py`` (the benchmarks are scripts, not a package)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module(name)


def netns_available(tc: bool = False) -> bool:
    """Whether this process may create network namespaces (root, iproute2; ``tc`` too if asked)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or (tc and shutil.which("tc") is None):
        return False
    name = f"{_netns_names()[0]}probe{uuid.uuid4().hex[:6]}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


def _netns_names():
    """DDPX_TEST_NETNS="NSPREFIX,VETHPREFIX,A.B": namespace and veth name prefixes and a /16
    of your own, for tests sharing a machine."""
    return os.environ.get("DDPX_TEST_NETNS", "ddpxt,vt,10.213").split(",")


def _sh(*cmd):
    subprocess.run([str(c) for c in cmd], check=True, capture_output=True)


@contextlib.contextmanager
def _namespaces(count: int, switch: bool = False):
    """``count`` host namespaces (and a "switch" one), lo up in each, removed on exit whatever
    happened: yields ``(hosts, switch_ns, tag)``, ``hosts`` = ``[(namespace, interface, address)]``
    at <A.B>.<random subnet>.1, .2, ... /24 (see _netns_names); the interfaces are named, not made."""
    tag = uuid.uuid4().hex[:6]
    ns_prefix, veth_prefix, net16 = _netns_names()
    subnet = f"{net16}.{random.randint(1, 250)}"
    names = "ab" if count == 2 and not switch else [str(i) for i in range(count)]
    hosts = [(f"{ns_prefix}{tag}{end}", f"{veth_prefix}{tag}{end}", f"{subnet}.{i + 1}") for i, end in enumerate(names)]
    switch_ns = f"{ns_prefix}{tag}sw" if switch else None
    made = []
    try:
        for ns in [h[0] for h in hosts] + ([switch_ns] if switch else []):
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield hosts, switch_ns, tag
    finally:
        for ns in made:  # deleting a namespace deletes its end of every veth pair too
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _host_end(ns: str, iface: str, addr: str, rate=None) -> None:
    """Move ``iface`` into ``ns`` with ``addr``/24, up; ``rate`` shapes what it sends (tbf)."""
    _sh("ip", "link", "set", iface, "netns", ns)
    _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
    _sh("ip", "-n", ns, "link", "set", iface, "up")
    if rate:
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root", "tbf",
            "rate", rate, "burst", "1mb", "latency", "100ms")


@contextlib.contextmanager
def two_hosts(rate=None):
    """Two namespaces joined by a veth pair: yields ``[(namespace, interface, address)] * 2``
    at 10.213.<n>.1 and .2 (/24; see _netns_names), lo up in both. ``rate`` (tc syntax, e.g. ``"100mbit"``)
    shapes both directions with tbf. Removed on exit, whatever happened."""
    with _namespaces(2) as (hosts, _, _):
        _sh("ip", "link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for ns, iface, addr in hosts:
            _host_end(ns, iface, addr, rate)
        yield hosts


@contextlib.contextmanager
def hosts(n: int, rate=None):
    """``n`` namespaces joined by a switch: a bridge in a namespace of its own with one veth
    pair per host (host side: the yielded interface; switch side: the same name with "s" before
    its number). Yields ``[(namespace, interface, address)] * n`` at <A.B>.<n>.1, .2, ... (/24;
    see _netns_names), lo up in each; ``rate`` shapes what each host sends (tbf). Removed on
    exit, whatever happened."""
    with _namespaces(n, switch=True) as (found, switch, tag):
        bridge = f"{_netns_names()[1]}{tag}br"
        _sh("ip", "-n", switch, "link", "add", bridge, "type", "bridge")
        _sh("ip", "-n", switch, "link", "set", bridge, "up")
        for i, (ns, iface, addr) in enumerate(found):
            port = f"{_netns_names()[1]}{tag}s{i}"
            _sh("ip", "link", "add", iface, "type", "veth", "peer", "name", port)
            _sh("ip", "link", "set", port, "netns", switch)
            _sh("ip", "-n", switch, "link", "set", port, "master", bridge)
            _sh("ip", "-n", switch, "link", "set", port, "up")
            _host_end(ns, iface, addr, rate)
        yield found


if __name__ == "__main__":
    _rank_main(sys.argv[1:])


# --- what the ``ranks`` fixture hands a test -------------------------------------------------

current_test = None  # the running test item, set by conftest.py before its fixtures


def require_slow_mark() -> None:
    """A test that starts processes must be marked ``slow``: the fast lane
    (``-m "not slow"``) starts none."""
    if current_test is not None and current_test.get_closest_marker("slow") is None:
        raise AssertionError(f"{current_test.nodeid} starts processes but is not marked slow "
                             "(@pytest.mark.slow): the fast lane must not start any")


class Ranks:
    """The ``ranks`` fixture: every way a test starts processes."""

    run = staticmethod(run)
    cli = staticmethod(run_cli)
    commands = staticmethod(run_commands)
    call = staticmethod(call_ranks)
    train = staticmethod(train_ranks)
    two_hosts = staticmethod(two_hosts)
    hosts = staticmethod(hosts)
