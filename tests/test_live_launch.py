"""The launcher side of live recovery (elastic.recovery: live, docs/recovery.md): torchrun's
command line and the workers' variables for a node that is its replica group of its own, the
options that cannot go with it, a missing torchft, a Lighthouse that does not answer; and
``ddpx lighthouse`` itself (slow: it starts the server)."""

import json
import os
import signal
import socket
import sys

import pytest

import harness
from ddpx import net
from ddpx.cli import build_parser
from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.launch import live
from ddpx.launch.options import LaunchOptions, check_options, live_overrides, options_from_args
from ddpx.launch.torchrun import torchrun_argv
from ddpx.rank.launcher_contract import LIGHTHOUSE_ENV, QUORUM_RETRIES_ENV, REPLICA_GROUP_ENV
from ddpx.recovery import lighthouse
from ddpx.recovery.torchft_import import require_torchft

TORCHFT_MISSING = ("elastic.recovery=live needs torchft, which is not installed: pip install 'ddpx[ft]' "
                   "(torchft-nightly==2026.10.26)")


@pytest.fixture
def clean_env(monkeypatch):
    """No interface, PET_*, SLURM or live variables; torchft taken as installed (the tests of a
    missing one say so); whatever the launcher sets in os.environ is undone after."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith(("PET_", "SLURM_", "TORCHFT_"))] + [
            "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", REPLICA_GROUP_ENV, live.LIGHTHOUSE_WAIT_ENV]:
        os.environ.pop(name, None)
    monkeypatch.setattr(live, "require_torchft", lambda what: None)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.1 standing in for the Lighthouse (nothing answers; it accepts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def _live_argv(*overrides, opts=None, lighthouse_at=None):
    extra = [f"elastic.lighthouse=127.0.0.1:{lighthouse_at}"] if lighthouse_at else []
    config = load_config(None, ["elastic.recovery=live", *extra, *overrides])
    return torchrun_argv(opts or LaunchOptions(nproc_per_node="1"), config.launch, None, [], config.elastic)


def _value(argv, flag):
    (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    return value


def test_a_live_node_on_loopback_is_a_single_node_job_named_by_its_store(clean_env, listener, capsys):
    argv = _live_argv("elastic.lighthouse_retries=7", lighthouse_at=listener)
    port = int(_value(argv, "--master-port"))
    assert argv[:7] == ["--nproc-per-node=1", "--nnodes=1", "--rdzv-backend=static", "--master-addr=127.0.0.1",
                        f"--master-port={port}", "--node-rank=0", "--max-restarts=0"]
    assert not [a for a in argv if a.startswith(("--rdzv-endpoint", "--rdzv-conf", "--local-addr"))]
    assert os.environ[LIGHTHOUSE_ENV] == f"http://127.0.0.1:{listener}"
    assert os.environ[QUORUM_RETRIES_ENV] == "7"
    assert os.environ[REPLICA_GROUP_ENV] == f"127.0.0.1:{port}"
    assert "GLOO_SOCKET_IFNAME" not in os.environ and "NCCL_SOCKET_IFNAME" not in os.environ
    assert capsys.readouterr().err == \
        f"ddpx: replica group 127.0.0.1:{port} of the live run at Lighthouse 127.0.0.1:{listener}\n"


def test_groups_on_one_machine_get_names_of_their_own(clean_env, listener):
    groups = set()
    with socket.socket() as taken:  # the first group's store, as torchrun would hold it
        _live_argv(lighthouse_at=listener)
        first = os.environ[REPLICA_GROUP_ENV]
        taken.bind(("127.0.0.1", int(first.rpartition(":")[2])))
        groups.add(first)
        _live_argv(lighthouse_at=listener)
        groups.add(os.environ[REPLICA_GROUP_ENV])
    assert len(groups) == 2


def test_a_node_away_from_the_lighthouse_advertises_its_address_on_the_route_there(clean_env, capsys):
    clean_env.setattr(net, "route_to", lambda host, port: net.Route(host, port, "10.0.0.1", False, "10.0.0.2", "eth7"))
    clean_env.setattr(net, "free_port", lambda host: 29731)
    clean_env.setattr(net, "connect_probe", lambda addr, port, timeout=3.0: "open")
    config = load_config(None, [])
    argv = torchrun_argv(LaunchOptions(nproc_per_node="2", lighthouse="10.0.0.1:29510"), config.launch, None, [],
                         load_config(None, live_overrides(LaunchOptions(lighthouse="10.0.0.1:29510"))).elastic)
    assert "--master-addr=10.0.0.2" in argv and "--master-port=29731" in argv and "--nnodes=1" in argv
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "eth7"
    assert os.environ[LIGHTHOUSE_ENV] == "http://10.0.0.1:29510"
    assert os.environ[QUORUM_RETRIES_ENV] == "30"
    assert os.environ[REPLICA_GROUP_ENV] == "10.0.0.2:29731"
    assert capsys.readouterr().err.splitlines() == [
        "ddpx: replica group 10.0.0.2:29731: GLOO_SOCKET_IFNAME=eth7 NCCL_SOCKET_IFNAME=eth7 (the interface that "
        "reaches the Lighthouse 10.0.0.1; set these variables yourself to choose another)",
        "ddpx: replica group 10.0.0.2:29731 of the live run at Lighthouse 10.0.0.1:29510"]


def test_the_lighthouse_flag_is_live_recovery_at_that_address():
    args, _ = build_parser().parse_known_args(["train", "cfg.yaml", "--lighthouse", "10.0.0.1:29510"])
    opts = options_from_args(args)
    assert opts.lighthouse == "10.0.0.1:29510"
    assert live_overrides(opts) == ["elastic.recovery=live", "elastic.lighthouse=10.0.0.1:29510"]
    assert live_overrides(LaunchOptions()) == []
    assert load_config(None, live_overrides(opts)).elastic.lighthouse == "10.0.0.1:29510"


@pytest.mark.parametrize("value", ["10.0.0.1", "10.0.0.1:port", ":29510", "10.0.0.1:0", "http://h:1/x"])
def test_a_lighthouse_that_is_not_host_port_is_one_line(value):
    with pytest.raises(DdpxError) as err:
        check_options(LaunchOptions(lighthouse=value), env={})
    assert "--lighthouse" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("opts, env, named", [
    (LaunchOptions(nnodes="2"), {}, "--nnodes 2"),
    (LaunchOptions(nnodes="1:2"), {}, "--nnodes 1:2"),
    (LaunchOptions(rdzv_endpoint="10.0.0.1:29400"), {}, "--rdzv-endpoint 10.0.0.1:29400"),
    (LaunchOptions(node_rank=1), {}, "--node-rank 1"),
    (LaunchOptions(rdzv_backend="c10d"), {}, "--rdzv-backend c10d"),
    (LaunchOptions(), {"PET_NNODES": "2"}, "PET_NNODES=2"),
])
def test_multi_node_options_cannot_go_with_live_recovery(clean_env, opts, env, named):
    os.environ.update(env)
    with pytest.raises(DdpxError) as err:
        _live_argv("elastic.lighthouse=127.0.0.1:29510", opts=opts)
    assert str(err.value) == f"{named} cannot go with elastic.recovery=live; {live.CONFLICT_FIX}"
    assert REPLICA_GROUP_ENV not in os.environ


def test_launch_nnodes_in_the_config_cannot_go_with_live_recovery_either(clean_env):
    with pytest.raises(DdpxError, match=r"^launch.nnodes=2 cannot go with elastic.recovery=live; under "):
        _live_argv("elastic.lighthouse=127.0.0.1:29510", "launch.nnodes=2")


def test_node_rank_0_is_fine(clean_env, listener):
    assert "--node-rank=0" in _live_argv(lighthouse_at=listener, opts=LaunchOptions(nproc_per_node="1", node_rank=0))


def test_a_slurm_step_of_several_nodes_is_a_group_per_task(clean_env, listener):
    os.environ.update({"SLURM_JOB_ID": "7", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
                       "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_PROCID": "1"})
    argv = _live_argv(lighthouse_at=listener)
    assert "--nnodes=1" in argv and "--node-rank=0" in argv


def test_live_recovery_without_a_lighthouse_is_one_line(clean_env):
    with pytest.raises(DdpxError) as err:
        _live_argv()
    assert str(err.value) == ("elastic.recovery=live needs the run's Lighthouse: give --lighthouse HOST:PORT (where "
                              "`ddpx lighthouse` runs) or set elastic.lighthouse")


def test_a_missing_torchft_is_one_line_before_anything_is_probed(clean_env, monkeypatch):
    monkeypatch.setattr(live, "require_torchft", require_torchft)
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` fails as when it is not installed
    monkeypatch.setattr(net, "route_to", lambda *a: pytest.fail("probed the network before checking torchft"))
    with pytest.raises(DdpxError) as err:
        _live_argv("elastic.lighthouse=127.0.0.1:29510")
    assert str(err.value) == TORCHFT_MISSING
    with pytest.raises(DdpxError, match=r"^ddpx lighthouse needs torchft, which is not installed: pip install"):
        lighthouse.serve(port=harness.free_port())


def test_a_lighthouse_that_never_answers_says_where_to_start_one(clean_env, capsys):
    port = harness.free_port()  # nothing listens there
    os.environ[live.LIGHTHOUSE_WAIT_ENV] = "0.2"
    with pytest.raises(DdpxError) as err:
        _live_argv(f"elastic.lighthouse=127.0.0.1:{port}")
    assert str(err.value) == (f"the Lighthouse at 127.0.0.1:{port} does not answer (refused) after 0.2 s; start "
                              f"`ddpx lighthouse --port {port}` on 127.0.0.1 first (wait longer with "
                              f"{live.LIGHTHOUSE_WAIT_ENV}=SECONDS)")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ddpx: replica group 127.0.0.1:") and line.endswith(
        f": waiting up to 0.2 s for the Lighthouse at 127.0.0.1:{port} (refused)")
    assert REPLICA_GROUP_ENV not in os.environ and LIGHTHOUSE_ENV not in os.environ


def test_the_restart_path_ignores_the_elastic_section(clean_env):
    config = load_config(None, [])
    port = harness.free_port()
    opts = LaunchOptions(nproc_per_node="1", master_port=port)
    assert torchrun_argv(opts, config.launch, None, [], config.elastic) == torchrun_argv(opts, config.launch, None, [])
    assert REPLICA_GROUP_ENV not in os.environ and LIGHTHOUSE_ENV not in os.environ


@pytest.mark.parametrize("kwargs, message", [
    (dict(port=0), "--port must be a port number from 1 to 65535, got 0"),
    (dict(min_groups=0), "--min-groups must be >= 1 (replica groups a quorum needs), got 0"),
    (dict(heartbeat_timeout_s=0.0), "--heartbeat-timeout-s must be > 0 seconds, got 0"),
    (dict(join_timeout_s=-1.0), "--join-timeout-s must be >= 0 seconds, got -1"),
    (dict(quorum_tick_ms=0), "--quorum-tick-ms must be >= 1, got 0"),
])
def test_the_lighthouses_options_are_checked_in_one_line(kwargs, message):
    with pytest.raises(DdpxError) as err:
        lighthouse.serve(**{"port": 29510, **kwargs})
    assert str(err.value) == message


def test_the_lighthouse_binds_as_torchft_spells_it():
    assert lighthouse.bind_address("0.0.0.0", 29510) == "0.0.0.0:29510"
    assert lighthouse.bind_address("::", 29510) == "[::]:29510"
    assert lighthouse.bind_address("[::1]", 1) == "[::1]:1"
    assert lighthouse.reach_host("10.1.2.3") == "10.1.2.3"


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_ddpx_lighthouse_listens_says_how_to_reach_it_and_stops_on_a_signal(ranks, tmp_path, signum, code):
    pytest.importorskip("torchft")
    port = harness.free_port("0.0.0.0")
    log = tmp_path / "lighthouse.log"
    proc = harness.start([sys.executable, "-m", "ddpx", "lighthouse", "--port", port, "--heartbeat-timeout-s", "1"],
                         log, harness.base_env())
    try:
        listening = lambda: "ddpx lighthouse: listening" in log.read_text() or proc.poll() is not None  # noqa: E731
        assert harness.wait_for(listening, 60), log.read_text()
        assert proc.poll() is None, log.read_text()
        (line,) = [line for line in log.read_text().splitlines() if line.startswith("ddpx lighthouse:")]
        assert line.startswith(f"ddpx lighthouse: listening on 0.0.0.0:{port} (a quorum needs 1 replica group, ")
        assert "heartbeat timeout 1 s" in line and f"--lighthouse " in line and line.endswith(f":{port}`")
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        if signum == signal.SIGTERM:  # a second one on the same port: busy, one line, before torchft loads
            busy, out, err = ranks.cli(["lighthouse", "--port", str(port)], timeout=60)
            assert busy == 2 and err.strip().count("\n") == 0 and "Traceback" not in err, err
            assert f"port {port} on 0.0.0.0 is busy" in err and "--port" in err
        proc.send_signal(signum)
        assert harness.wait_for(lambda: proc.poll() is not None, 10), log.read_text()
    finally:
        harness.finish([proc], [log], timeout=0)
    assert proc.returncode == code, log.read_text()
    assert f"ddpx lighthouse: stopped ({signal.Signals(signum).name})" in log.read_text()
    assert net.connect_probe("127.0.0.1", port, timeout=1.0) == "refused"


@pytest.mark.slow
def test_two_groups_on_one_machine_start_their_workers_with_the_live_variables(ranks, tmp_path):
    """Two `ddpx train --lighthouse` on one machine: two single-node jobs, whose workers see the
    Lighthouse, the retries and their own group's name (its store, MASTER_ADDR:MASTER_PORT)."""
    pytest.importorskip("torchft")
    (tmp_path / "seen.py").write_text(
        "import json, os\n"
        "from ddpx import hookimpl\n\n"
        "@hookimpl\n"
        "def ddpx_setup(trainer):\n"
        "    names = ('TORCHFT_LIGHTHOUSE', 'TORCHFT_QUORUM_RETRIES', 'DDPX_REPLICA_GROUP', 'MASTER_ADDR', 'MASTER_PORT',\n"
        "             'WORLD_SIZE')\n"
        "    with open(os.path.join(trainer.config.run_dir, 'seen.json'), 'w') as f:\n"
        "        json.dump({n: os.environ.get(n) for n in names}, f)\n")
    port = harness.free_port("0.0.0.0")
    log = tmp_path / "lighthouse.log"
    lh = harness.start([sys.executable, "-m", "ddpx", "lighthouse", "--port", port], log, harness.base_env())
    try:
        cmds = [[sys.executable, "-m", "ddpx", "train", "--nproc-per-node", "1", "--lighthouse", f"127.0.0.1:{port}",
                 f"run_dir={tmp_path / name}", "trainer.epochs=1", "trainer.max_steps=2", "trainer.eval_every_epochs=0",
                 "logging.progress=false", "model.args.hidden=16", "plugins.enable=[seen]",
                 "elastic.lighthouse_retries=5"] for name in ("a", "b")]
        ended = ranks.commands(cmds, tmp_path, timeout=240, cwd=tmp_path, names=["a", "b"])
    finally:
        harness.finish([lh], [log], timeout=0)
    seen = []
    for name, end in zip("ab", ended):
        assert end.returncode == 0, end.output[-3000:]
        group = json.loads((tmp_path / name / "seen.json").read_text())
        assert f"ddpx: replica group {group['DDPX_REPLICA_GROUP']} of the live run at Lighthouse 127.0.0.1:{port}" \
            in end.output
        assert group == {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "TORCHFT_QUORUM_RETRIES": "5",
                         "DDPX_REPLICA_GROUP": f"127.0.0.1:{group['MASTER_PORT']}", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": group["MASTER_PORT"], "WORLD_SIZE": "1"}
        seen.append(group["DDPX_REPLICA_GROUP"])
    assert seen[0] != seen[1]
