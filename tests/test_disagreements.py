"""Ranks that disagree, or hang, explained in seconds (ddpx/rank/watchdog.py,
ddpx/rank/failures.py, ddpx/train/model_checks.py).

The fast tests check the pieces against hand-made inputs (fingerprints, the verdict,
the watchdog's exchange through a store, DDP's error text); the slow ones run
``ddpx train`` on 2 ranks with a user's project in which a rank goes its own way
and check the job ends quickly, in a few lines, naming the right code."""

from __future__ import annotations

import os
import re
import sys
import textwrap
import threading
import types

import pytest
import torch
import torch.distributed as dist

import harness
from ddpx.errors import RanksDisagree
from ddpx.plugin.manager import make_plugin_manager, plugin_code_map
from ddpx.plugin.markers import hookimpl
from ddpx.rank import failures, watchdog
from ddpx.rank.watchdog import CollectiveWatchdog, Watch, caller, describe, first_difference
from ddpx.train import model_checks


# --- fingerprints ------------------------------------------------------------------------------

def test_a_fingerprint_names_the_op_its_tensors_reduce_op_and_root():
    one = torch.zeros(1)
    assert describe("all_reduce", (one,), {}) == "all_reduce(float32[1], SUM)"
    assert describe("all_reduce", (one.int(),), {"op": dist.ReduceOp.MIN}) == "all_reduce(int32[1], MIN)"
    assert describe("broadcast", (torch.zeros(2, 3, dtype=torch.float64),), {"src": 0}) == \
        "broadcast(float64[2, 3], src=0)"
    assert describe("all_gather", ([one, one], one), {}) == "all_gather(2 x float32[1], float32[1])"
    assert describe("barrier", (), {}) == "barrier()"


class Counting:
    """A plugin whose epoch-end hook issues a collective through a helper."""

    def __init__(self, log):
        self.log = log

    @hookimpl
    def ddpx_epoch_end(self, trainer, epoch, metrics):
        return self.sync()

    def sync(self):
        return watchdog._stack(sys._getframe())


def test_the_caller_is_the_plugin_and_hook_on_the_stack_and_the_innermost_line_of_user_code():
    pm = make_plugin_manager(None, builtins=False, entry_points=False)
    plugin = Counting(None)
    pm.register(plugin, name="myplug")
    stack = pm.hook.ddpx_epoch_end(trainer=None, epoch=0, metrics={})[0]
    line = Counting.sync.__code__.co_firstlineno + 1
    assert caller(stack, plugin_code_map(pm)) == f"from plugin 'myplug' in ddpx_epoch_end (test_disagreements.py:{line})"
    # Called outside a hook, a plugin's method still names the plugin; other code names its function.
    assert caller(plugin.sync(), plugin_code_map(pm)).startswith("from plugin 'myplug' in Counting.sync ")
    assert caller(watchdog._stack(sys._getframe()), plugin_code_map(pm)).startswith(
        "in test_the_caller_is_the_plugin_and_hook_on_the_stack")


def test_recorded_collectives_are_the_blocking_ones_on_the_default_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    log = CollectiveWatchdog(0, 1, 15.0, lambda: {"step": 0}, store=store)
    original = dist.all_reduce
    try:
        log.install()
        other = dist.new_group([0])
        dist.all_reduce(torch.ones(1))
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX)
        dist.all_reduce(torch.ones(3), async_op=True).wait()  # comm hooks, the stop vote: not recorded
        dist.all_reduce(torch.ones(4), group=other)  # another group: not recorded
        dist.barrier()
    finally:
        log.uninstall()
        dist.destroy_process_group()
    assert dist.all_reduce is original
    assert [(fp.seq, fp.signature) for fp in log.history] == [
        (1, "all_reduce(float32[1], SUM)"), (2, "all_reduce(float32[2], MAX)"), (3, "barrier()")]
    assert log.in_flight is None and log.digest != 0


# --- the verdict ---------------------------------------------------------------------------------

def answer(rank, history, in_flight=None, step=5, where="in Trainer.backward (trainer.py:1)"):
    return {"rank": rank, "history": history, "in_flight": in_flight, "waited_s": 16.0 if in_flight else None,
            "where": where, "progress": {"step": step, "epoch": 0, "batch": 3, "batches": 23}, "stacks": None}


A = "from plugin 'checkpoint' in ddpx_epoch_end (checkpoint.py:306)"
B = "from plugin 'myplug' in ddpx_epoch_end (myplug.py:10)"


def test_the_first_differing_collective_is_named_with_each_rank_and_its_caller():
    rank0 = answer(0, [[4, "all_reduce(float32[2], SUM)", "in Trainer._epoch_train_loss (trainer.py:9)"],
                       [5, "all_reduce(float32[1], SUM)", B], [6, "all_reduce(int32[1], MIN)", A]], in_flight=6)
    rank1 = answer(1, [[4, "all_reduce(float32[2], SUM)", "in Trainer._epoch_train_loss (trainer.py:9)"],
                       [5, "all_reduce(int32[1], MIN)", A]])
    lines = first_difference([rank0, rank1])
    assert lines[:3] == ["the ranks issued different collectives: collective 5 differs",
                         f"  rank 0: all_reduce(float32[1], SUM) {B}",
                         f"  rank 1: all_reduce(int32[1], MIN) {A}"]
    # Ranks that agree are grouped.
    more = [answer(r, rank1["history"]) for r in (2, 3, 5)] + [answer(4, rank0["history"])]
    lines = first_difference([rank0, rank1, *more])
    assert lines[1:3] == [f"  ranks 0, 4: all_reduce(float32[1], SUM) {B}",
                          f"  ranks 1-3, 5: all_reduce(int32[1], MIN) {A}"]


def test_a_rank_that_is_only_behind_is_no_difference():
    behind = answer(1, [[4, "all_reduce(float32[2], SUM)", A]])
    ahead = answer(0, [[4, "all_reduce(float32[2], SUM)", A], [5, "barrier()", B]], in_flight=5)
    assert first_difference([ahead, behind]) == []
    lines = watchdog.where_ranks_are([ahead, behind], 2, 15.0)
    assert lines[1] == f"  rank 0: waits 16 s in collective 5, barrier() {B}"
    assert lines[2] == "  rank 1: in Trainer.backward (trainer.py:1), at step 5, after collective 4"


class DictStore:
    """The store calls the watchdog makes, in memory (several ranks' logs share one)."""

    def __init__(self):
        self.data = {}

    def add(self, key, n):
        self.data[key] = int(self.data.get(key, 0)) + n
        return self.data[key]

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


@pytest.fixture
def blocked_thread():
    """A thread blocked at one line, standing in for a rank's main thread stuck in a call."""
    release = threading.Event()

    def park():
        release.wait()

    thread = threading.Thread(target=park, daemon=True)
    thread.start()
    yield thread.ident
    release.set()
    thread.join()


def two_ranks(tmp_path, rank0_history, rank1_history, main_thread, stall_s=15.0):
    store, exits, reports = DictStore(), [], []
    logs = []
    for rank, history in enumerate((rank0_history, rank1_history)):
        log = CollectiveWatchdog(rank, 2, stall_s, lambda: {"step": 7, "epoch": 0, "batch": 7, "batches": 23},
                            run_dir=tmp_path, store=store)
        for seq, signature in history:
            log.history.append(watchdog.Fingerprint(seq, signature, watchdog._stack(sys._getframe())))
            log.seq = seq
        log.exit = lambda code, rank=rank: exits.append((rank, code))
        log._main_thread = main_thread
        log.report = reports.append
        logs.append(log)
    return logs, exits, reports


def test_a_rank_stuck_in_a_collective_that_differs_ends_every_rank(tmp_path, blocked_thread):
    (log0, log1), exits, reports = two_ranks(
        tmp_path, [(1, "all_reduce(float32[1], SUM)"), (2, "all_reduce(int32[1], MIN)")],
        [(1, "all_reduce(int32[1], MIN)")], blocked_thread)
    log0.in_flight, log0.in_flight_since = log0.history[-1], 100.0
    watch0, watch1 = Watch(), Watch()
    log0.look(watch0, 110.0)  # 10 s: not yet
    log1.look(watch1, 110.0)
    assert not exits and not reports
    log0.look(watch0, 115.5)  # rank 0 waited stall_s in one collective: it asks, and answers
    log1.look(watch1, 116.0)  # rank 1 answers
    log0.look(watch0, 116.5)  # rank 0 has every answer: the verdict (it waits up to 3 s for rank 1 to read it)
    assert exits == [(0, 2)]
    assert "collective 1 differs" in reports[0] and "rank 0: all_reduce(float32[1], SUM)" in reports[0]
    log1.look(watch1, 117.0)  # rank 1 reads the verdict and ends too
    assert exits == [(0, 2), (1, 2)]
    assert (tmp_path / "stalls" / "rank0.txt").exists() and (tmp_path / "stalls" / "rank1.txt").exists()


def test_a_stall_without_a_difference_reports_where_each_rank_is_and_goes_on(tmp_path, blocked_thread):
    (log0, log1), exits, reports = two_ranks(tmp_path, [(1, "barrier()")], [(1, "barrier()")], blocked_thread)
    watch0, watch1 = Watch(), Watch()
    log0.look(watch0, 100.0)  # the last progress
    log1.look(watch1, 100.0)
    log1.look(watch1, 129.0)  # no progress for 2 x stall_s - 1: nothing yet
    assert log1.store.add(f"{watchdog.KEY}/asked", 0) == 0
    log1.look(watch1, 130.5)  # no step for 2 x stall_s: rank 1 asks
    log0.look(watch0, 131.0)
    log0.look(watch0, 131.5)
    assert exits == [] and len(reports) == 1
    assert "  rank 0: in blocked_thread.<locals>.park (test_disagreements.py:" in reports[0], reports[0]
    assert "  rank 1: in blocked_thread.<locals>.park" in reports[0] and "every thread's stack" in reports[0]
    log1.look(watch1, 132.0)
    assert exits == []  # the verdict was "stall": the job goes on
    log1.look(watch1, 133.0)
    assert log1.store.add(f"{watchdog.KEY}/asked", 0) == 1  # asked once per stall


def test_a_busy_main_thread_is_progress_even_without_steps(tmp_path):
    (log0, _), exits, reports = two_ranks(tmp_path, [(1, "barrier()")], [(1, "barrier()")],
                                          threading.main_thread().ident)
    watch = Watch()
    for t in range(100, 160, 2):  # a minute of evaluation: this thread's stack differs at every look
        log0.look(watch, float(t))
        log0.look(watch, float(t + 1))
    assert log0.store.add(f"{watchdog.KEY}/asked", 0) == 0 and not reports


# --- the same checks every epoch -------------------------------------------------------------------

def test_ranks_agree_at_epoch_boundaries_in_one_small_all_reduce(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    log = CollectiveWatchdog(0, 1, 15.0, lambda: {"step": 0}, store=store)
    try:
        log.install()
        log.agree({"batches in this epoch": 23})  # one rank always agrees with itself
        assert [fp.signature for fp in log.history] == ["all_reduce(float64[4], MAX)"]
    finally:
        log.uninstall()
        dist.destroy_process_group()


# --- DDP's errors, told as parameter names ----------------------------------------------------------

class Skipper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.expert = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)


DDP_TEXT = ("Expected to have finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your module has parameters that were not used in producing loss. ...\n"
            "Parameter indices which did not receive grad for rank 1: 2 3\n In addition, you can set ...")


def test_unused_parameters_are_named_with_the_step_and_both_fixes():
    ddp = types.SimpleNamespace(module=Skipper(), parameters_to_ignore=[], static_graph=False)
    error = model_checks.explain_unused(RuntimeError(DDP_TEXT), ddp, step=12)
    assert str(error).startswith("expert.weight, expert.bias (2 of 6 parameters) got no gradient in step 12, ")
    assert "trainer.find_unused_parameters: true" in str(error) and "make every step's forward use them" in str(error)
    assert model_checks.explain_unused(RuntimeError("something else"), ddp, step=12) is None
    detail = DDP_TEXT.replace("Parameter indices which did not receive grad for rank 1: 2 3",
                              "Parameters which did not receive grad for rank 1: expert.bias, expert.weight")
    assert str(model_checks.explain_unused(RuntimeError(detail), ddp, 3)).startswith("expert.bias, expert.weight (2 ")
    # Frozen parameters are not DDP's: the indices count only those that train.
    frozen = Skipper()
    frozen.body.weight.requires_grad_(False)
    ddp = types.SimpleNamespace(module=frozen, parameters_to_ignore=[], static_graph=True)
    error = str(model_checks.explain_unused(RuntimeError(DDP_TEXT), ddp, 1))
    assert error.startswith("expert.bias, head.weight (2 of 5 parameters)") and "static_graph" in error


# --- blame only the guilty ----------------------------------------------------------------------------

def test_a_broken_connection_is_another_ranks_failure_and_names_it_when_the_store_knows():
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:40123")
    assert failures.is_peer_failure(closed)
    assert failures.is_peer_failure(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 5000ms for recv"))
    assert not failures.is_peer_failure(ValueError("bad metric file"))
    assert not failures.is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))

    store = DictStore()
    store.compare_set = lambda key, expected, value: store.data.setdefault(key, value.encode())
    store.timeout, store.set_timeout = None, lambda timeout: None
    assert failures.peer_failure_line(closed, store, 12) .startswith(
        "stopped at step 12: another rank failed, hung or lost its host (the connection to 10.0.0.2 broke)")
    failures.record_first_failure(store, 1, ValueError("bad metric file"))
    failures.record_first_failure(store, 0, RuntimeError("later"))  # the first one wins
    assert failures.peer_failure_line(closed, store, 12) == \
        "stopped at step 12: rank 1 failed first: ValueError: bad metric file"


# --- as a user meets it: ddpx train on 2 ranks ----------------------------------------------------------

PROJECT = {
    "myplug.py": """
        import time

        import torch
        import torch.distributed as dist
        from ddpx import hookimpl


        @hookimpl
        def ddpx_epoch_end(trainer, epoch, metrics):
            if trainer.is_main:
                open("disagreed_at", "w").write(repr(time.time()))
                dist.all_reduce(torch.ones(1))  # rank 0 only: pairs with rank 1's next collective
    """,
    "skipmodel.py": """
        import torch
        from torch import nn


        class Skipper(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Linear(64, 32)
                self.expert = nn.Linear(32, 32)
                self.head = nn.Linear(32, 10)

            def forward(self, x):
                h = torch.relu(self.body(x))
                if x[0, 0] > 0:
                    h = h + self.expert(h)
                return self.head(h)
    """,
    "rankmodel.py": """
        import os
        from torch import nn


        def build():
            hidden = 32 if os.environ["RANK"] == "1" else 16
            return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    """,
    "skipplug.py": """
        from ddpx import hookimpl


        @hookimpl(tryfirst=True)
        def ddpx_optimizer_step(trainer):
            if trainer.rank == 1 and trainer.global_step == 3:
                return False  # decided from this rank's own values
    """,
    "unevenplug.py": """
        from torch.utils.data import DataLoader, Subset
        from ddpx import hookimpl


        @hookimpl(tryfirst=True)
        def ddpx_build_dataloaders(trainer, train_set, eval_set):
            half = len(train_set) // 2
            mine = range(0, half) if trainer.rank == 0 else range(half - 200, len(train_set))
            return DataLoader(Subset(train_set, mine), batch_size=32), DataLoader(eval_set, batch_size=256)
    """,
    "driftplug.py": """
        import torch
        from ddpx import hookimpl


        @hookimpl
        def ddpx_batch_end(trainer, batch_index, loss, stepped):
            if trainer.rank == 1 and batch_index == 5:
                with torch.no_grad():
                    next(trainer.module.parameters()).add_(0.01)  # an update only rank 1 applies
    """,
    "badplug.py": """
        from ddpx import hookimpl


        @hookimpl
        def ddpx_epoch_end(trainer, epoch, metrics):
            if trainer.rank == 1 and epoch == 1:
                raise ValueError("bad metric file")
    """,
    "slowdata.py": """
        import os
        import time

        import torch
        from torch.utils.data import Dataset


        class Digits(Dataset):
            def __init__(self, n):
                self.x, self.y = torch.randn(n, 64), torch.randint(0, 10, (n,))
                self.calls = 0

            def __len__(self):
                return len(self.x)

            def __getitem__(self, i):
                self.calls += 1
                if os.environ["RANK"] == "1" and self.calls == 200:
                    time.sleep(600)  # a deadlock in the user's data loading
                return self.x[i], self.y[i]


        def splits():
            return Digits(2000), Digits(200)
    """,
}


def train(ranks, tmp_path, *overrides, timeout=90):
    for name, text in PROJECT.items():
        (tmp_path / name).write_text(textwrap.dedent(text).lstrip())
    (tmp_path / "config.yaml").write_text("trainer: {epochs: 3}\nlogging: {progress: false}\n")
    start = harness.clock()
    code, out, err = ranks.cli(["train", "config.yaml", "--nproc-per-node", "2", f"run_dir={tmp_path / 'run'}",
                                *overrides], timeout=timeout, cwd=tmp_path, env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    # Progress lines, and the comm monitor's warning, which a slow step can bring on any run.
    failure = [line for line in (out + err).splitlines()
               if line.strip() and not re.match(r"\[rank\d\] (epoch \d|saved checkpoint|communication takes)", line)]
    return code, "\n".join(failure), harness.clock() - start


@pytest.mark.slow
def test_a_collective_on_rank_0_only_ends_the_job_naming_both_plugins(ranks, tmp_path):
    # trainer.stall_s=3 (10 by default): rank 0 asks after 3 s in the collective that differs
    code, out, _ = train(ranks, tmp_path, "plugins.enable=[myplug]", "trainer.stall_s=3")
    assert code == 2, out
    elapsed = harness.since(float((tmp_path / "disagreed_at").read_text()))
    assert elapsed < 20, f"the job ended {elapsed:.0f} s after the ranks disagreed"
    assert len(out.splitlines()) <= 15, out
    assert re.search(r"collective \d+ differs\n  rank 0: all_reduce\(float32\[1\], SUM\) from plugin 'myplug' "
                     r"in ddpx_epoch_end \(myplug.py:12\)\n  rank 1: all_reduce\(int32\[1\], MIN\) from plugin "
                     r"'checkpoint' in ddpx_epoch_end \(finite.py:\d+\)", out), out


@pytest.mark.slow
def test_a_submodule_skipped_on_some_batches_is_named_with_the_fix(ranks, tmp_path):
    code, out, elapsed = train(ranks, tmp_path, "model.target=skipmodel.Skipper", "model.args={}")
    assert code == 2, out
    assert elapsed < 30, f"took {elapsed:.0f} s"
    assert len(out.splitlines()) <= 15, out
    assert "expert.weight, expert.bias (2 of 6 parameters) got no gradient in step 1" in out, out
    assert "trainer.find_unused_parameters: true" in out and "Traceback" not in out, out
    # The fix named works.
    code, out, _ = train(ranks, tmp_path, "model.target=skipmodel.Skipper", "model.args={}",
                         "trainer.find_unused_parameters=true", "trainer.epochs=1", "trainer.max_steps=3")
    assert code == 0, out


@pytest.mark.slow
@pytest.mark.parametrize("overrides, expected", [
    (["model.target=rankmodel.build", "model.args={}"],
     "the model differs between ranks: tensor 0 is 0.weight float32[32, 64] on rank 1 but 0.weight "
     "float32[16, 64] on rank 0"),
    (["plugins.enable=[skipplug]"],
     "the ranks disagree on the skipped optimizer steps (rank 0: 0, rank 1: 1): a ddpx_optimizer_step hook "
     "(plugins: skipplug, trainer) returned False on some ranks only"),
    (["plugins.enable=[unevenplug]"],
     "the ranks disagree on the batches in this epoch (rank 0: 23, rank 1: 29)"),
    (["plugins.enable=[driftplug]"], "the ranks disagree on the sum of the weights (rank 0: "),
], ids=["model", "skipped_step", "uneven_batches", "drifting_weights"])
def test_other_disagreements_end_the_job_in_a_line(ranks, tmp_path, overrides, expected):
    code, out, elapsed = train(ranks, tmp_path, *overrides)
    assert code == 2, out
    assert elapsed < 30, f"took {elapsed:.0f} s"
    assert len(out.splitlines()) <= 15, out
    assert f"ddpx: error: {expected}" in out, out
    assert out.count(expected) == 1, out  # once per node, not once per rank


@pytest.mark.slow
def test_a_rank_that_fails_is_blamed_and_the_plugin_whose_collective_broke_is_not(ranks, tmp_path):
    code, out, _ = train(ranks, tmp_path, "plugins.enable=[badplug]")
    assert code == 1, out
    # One line, from the rank that failed; rank 0, whose collective broke because of it (in the
    # checkpoint plugin: innocent), stays silent on the same node (another node's would say
    # "stopped at step 46: rank 1 failed first: ...").
    assert out.splitlines() == ["ddpx: error: [rank1] plugin 'badplug' raised in ddpx_epoch_end: ValueError: "
                                "bad metric file (badplug.py:7)",
                                "ddpx: to resume this run: ddpx train config.yaml 'plugins.enable=[badplug]' "
                                f"run_dir={tmp_path / 'run'}"], out


@pytest.mark.slow
def test_a_hang_shows_where_every_rank_is_and_writes_their_stacks(ranks, tmp_path):
    # trainer.stall_s=3: the report comes 6 s into the hang (twice stall_s without progress),
    # timeout_s ends the job 6 s later.
    code, out, elapsed = train(ranks, tmp_path, "data.target=slowdata.splits", "data.args={}", "trainer.stall_s=3",
                               "trainer.timeout_s=12", "checkpoint.stop_timeout_s=3", timeout=120)
    assert code != 0, out
    assert "a rank made no progress for 3 s or more" in out, out
    assert re.search(r"  rank 0: in Trainer\.backward \(trainer\.py:\d+\), at step \d+", out), out
    assert re.search(r"  rank 1: in Digits\.__getitem__ \(slowdata\.py:19\), at step \d+", out), out
    stacks = (tmp_path / "run" / "stalls" / "rank1.txt").read_text()
    assert "time.sleep(600)" in stacks and 'Thread "MainThread"' in stacks
    assert (tmp_path / "run" / "stalls" / "rank0.txt").exists()
