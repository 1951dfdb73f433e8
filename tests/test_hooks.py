"""ddpx.comm_hooks on gloo (CPU), several processes: exactness, native == Python,
replica consistency, DDP modes, non-finite gradients, checkpointed state.

Each multi-process scenario runs once per module (a fixture) and several
tests assert on its results, to keep process start-ups few.
"""

import copy
import logging
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import harness

import ddpx.comm_hooks
from ddpx.errors import DdpxError

from hook_checks import ALL, LOSSY, NO_WARMUP, PART2, REL_TOL, batch, equal_lists, make_model, max_rel_err, train  # noqa: F401


# ---------------------------------------------------------------- workers
def equivalence_worker(rank, world):
    out = {("none", False): train(None, rank=rank)}
    for hook in ALL:
        for native in (False, True):
            out[(hook, native)] = train(hook, native, rank=rank)
    out[("int8-warmup", True)] = train("int8", True, rank=rank, warmup_steps=2)
    out[("int8-all", True)] = train("int8", True, rank=rank, min_numel=0, compress_vectors=True, block_size=64)
    return out


def spans_worker(rank, world):
    """int8 coded straight from the bucket (every compressed run is whole blocks) and
    through the packed buffer (what layouts with odd-sized parameters take)."""
    from ddpx.comm_hooks.int8 import Int8State

    original = Int8State.build_layout
    out, spans_seen = {}, []
    for packed in (False, True):
        def build(self, lay, packed=packed):
            original(self, lay)
            spans_seen.append((packed, lay.spans.shape[0]))
            if packed:
                lay.spans = lay.spans[:0]
                lay.comp = torch.zeros(self.world_size * lay.chunk)

        Int8State.build_layout = build
        try:
            for native in (False, True):  # block 8: every Net parameter is whole blocks
                out[(packed, native)] = train("int8", native, rank=rank, block_size=8)
        finally:
            Int8State.build_layout = original
    out["spans_seen"] = spans_seen
    return out


def modes_worker(rank, world):
    out = {}
    for mode in ("no_sync", "static_graph", "find_unused", "bucket_view"):
        out[(mode, "none")] = train(None, rank=rank, mode=mode)
        for hook in ("fp16", "int8"):
            out[(mode, hook)] = train(hook, True, rank=rank, mode=mode)
    # what ddp_options asks for: .grad as views of the buckets must not change a bit
    for hook in ALL + PART2:
        opts = NO_WARMUP.get(hook, {})
        out[("grads_in_buckets", hook)] = (train(hook, True, rank=rank, **opts),
                                           train(hook, True, rank=rank, mode="bucket_view", **opts))
    # non-finite gradients: step 1, rank 1, one element of fc2.weight
    for hook in ALL + PART2:
        for value in ("inf", "nan"):
            out[("inject", hook, value)] = train(hook, True, rank=rank, steps=3, inject=(1, 1, float(value)),
                                                **NO_WARMUP.get(hook, {}))
    # torch's own bf16 hook on gloo, next to ours
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = DDP(make_model())
    x, y = batch(0, rank)
    try:
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        out["torch_bf16"] = None
    except Exception as exc:  # noqa: BLE001 - recorded and asserted on
        out["torch_bf16"] = f"{type(exc).__name__}: {exc}"
    return out


def checkpoint_worker(rank, world):
    out = {}
    for native in (False, True):
        full = train("int8", native, rank=rank, steps=6, bucket_cap_mb=25)
        model_sd, opt_sd, hook_sd = full["saved"]
        net = make_model()
        net.load_state_dict(model_sd)
        resumed = train("int8", native, rank=rank, steps=3, first_step=3, model=net, state_sd=hook_sd,
                        opt_sd=opt_sd, bucket_cap_mb=25)
        net = make_model()
        net.load_state_dict(model_sd)
        fresh_sd = copy.deepcopy(hook_sd)
        fresh_sd["memory"] = {}
        no_memory = train("int8", native, rank=rank, steps=3, first_step=3, model=net, state_sd=fresh_sd,
                          opt_sd=opt_sd, bucket_cap_mb=25)
        out[native] = {"full": full["params"], "resumed": resumed["params"], "no_memory": no_memory["params"],
                       "hook_sd": hook_sd, "stats": resumed["stats"]}
    # loading a state saved with another world size / rank: warn, reset, keep counters
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ddpx.comm_hooks").addHandler(handler)
    state, _ = ddpx.comm_hooks.make("int8")
    ddp = DDP(make_model(), bucket_cap_mb=25)
    ddp.register_comm_hook(state, ddpx.comm_hooks.hook)
    x, y = batch(0, rank)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    sd = out[True]["hook_sd"]
    state.load_state_dict(dict(sd, world_size=world + 1))
    out["world_change"] = {
        "warnings": [r.getMessage() for r in records],
        "memory_zero": all(bool((t == 0).all()) for d in state.memory.values() for t in d.values()),
        "memory_count": sum(len(d) for d in state.memory.values()),
        "steps": state.stats()["steps"],
    }
    return out


def world3_worker(rank, world):
    out = {("none", False): train(None, rank=rank, steps=2)}
    for hook in ("allreduce", "int8", "fp16"):
        for native in (False, True):
            out[(hook, native)] = train(hook, native, rank=rank, steps=2)
    return out


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def equivalence(ranks):
    return ranks.call(equivalence_worker, 2, timeout=120)


@pytest.fixture(scope="module")
def modes(ranks):
    return ranks.call(modes_worker, 2, timeout=120)


@pytest.fixture(scope="module")
def checkpoint(ranks):
    return ranks.call(checkpoint_worker, 2, timeout=120)


# ------------------------------------------------------------------- tests
def test_available_names():
    assert {"allreduce", "fp16", "bf16", "int8"} <= set(ddpx.comm_hooks.available())


def test_without_warmup_makes_a_hook_compress_from_its_first_step():
    assert ddpx.comm_hooks.without_warmup("onebit") == {"warmup_steps": 0}
    assert ddpx.comm_hooks.make("powersgd", **ddpx.comm_hooks.without_warmup("powersgd"))[0].warming_up() is False
    assert ddpx.comm_hooks.without_warmup("allreduce") == {}  # it has no warm-up
    with pytest.raises(DdpxError, match="unknown comm hook 'nope'"):
        ddpx.comm_hooks.without_warmup("nope")


def test_old_import_path_gives_the_same_modules():
    import ddpx.hooks
    import ddpx.hooks.int8
    from ddpx.hooks.twophase import TwoPhaseState

    import ddpx.comm_hooks.twophase
    assert ddpx.hooks is ddpx.comm_hooks
    assert ddpx.hooks.int8 is ddpx.comm_hooks.int8
    assert TwoPhaseState is ddpx.comm_hooks.twophase.TwoPhaseState


def test_ddp_options_per_hook():
    # int8: the wire starts a layer into the backward pass; every hook writes into the
    # bucket, so DDP's copy of the bucket back into .grad is skipped
    assert ddpx.comm_hooks.ddp_options("int8") == {"gradient_as_bucket_view": True, "bucket_cap_mb": 4.0}
    for name in ("fp16", "allreduce", "onebit", "powersgd"):
        assert ddpx.comm_hooks.ddp_options(name) == {"gradient_as_bucket_view": True}
    with pytest.raises(DdpxError, match="unknown comm hook 'int9'; available: "):
        ddpx.comm_hooks.ddp_options("int9")


@pytest.mark.parametrize(
    "name,opts,needle",
    [
        ("int9", {}, "unknown comm hook 'int9'; available: "),
        ("int8", {"blocksize": 64}, "unknown option(s) blocksize; known options: block_size"),
        ("int8", {"block_size": 30}, "block_size must be a positive multiple of 4, got 30"),
        ("fp16", {"warmup_steps": -1}, "warmup_steps must be >= 0"),
        ("fp16", {"compress_vectors": 1}, "compress_vectors must be bool, got 1"),
        ("allreduce", {"min_numel": 5}, "unknown option(s) min_numel; known options: none"),
    ],
)
def test_bad_options_are_one_line_errors(name, opts, needle):
    with pytest.raises(DdpxError) as info:
        ddpx.comm_hooks.make(name, **opts)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_allreduce_is_bit_identical_to_ddp_without_hook(equivalence):
    for rank_out in equivalence:
        ref = rank_out[("none", False)]
        for native in (False, True):
            got = rank_out[("allreduce", native)]
            assert got["native"] is native
            for g, r in zip(got["grads"], ref["grads"]):
                assert equal_lists(g, r)
            assert equal_lists(got["params"], ref["params"])


@pytest.mark.parametrize("hook", LOSSY)
def test_lossy_first_step_within_format_rounding(equivalence, hook):
    ref = equivalence[0][("none", False)]["grads"][0]
    got = equivalence[0][(hook, False)]["grads"][0]
    weights = [i for i, r in enumerate(ref) if r.dim() > 1]
    err = max_rel_err([got[i] for i in weights], [ref[i] for i in weights])
    assert 0 < err < REL_TOL[hook], err  # compressed, and within the format's rounding
    # biases (1-D, exempt by default) are averaged exactly in fp32
    for i, r in enumerate(ref):
        if r.dim() == 1:
            assert torch.equal(got[i], r)


def test_compressing_everything_stays_close(equivalence):
    ref = equivalence[0][("none", False)]["grads"][0]
    got = equivalence[0][("int8-all", True)]["grads"][0]
    err = max_rel_err(got, ref)
    assert 0 < err < REL_TOL["int8"]
    assert not any(torch.equal(g, r) for g, r in zip(got, ref) if r.dim() == 1)  # biases compressed too


@pytest.mark.parametrize("hook", ALL)
def test_native_and_python_paths_are_bit_identical(equivalence, hook):
    for rank_out in equivalence:
        py, nat = rank_out[(hook, False)], rank_out[(hook, True)]
        assert py["native"] is False and nat["native"] is True
        for g, h in zip(py["grads"], nat["grads"]):
            assert equal_lists(g, h)
        assert equal_lists(py["params"], nat["params"])
        assert py["stats"] == nat["stats"]
        for name in py["memory"]:
            assert py["memory"][name].keys() == nat["memory"][name].keys()
            for k in py["memory"][name]:
                assert torch.equal(py["memory"][name][k], nat["memory"][name][k])


def test_replicas_stay_bit_identical(equivalence):
    r0, r1 = equivalence
    for key in r0:
        for g0, g1 in zip(r0[key]["grads"], r1[key]["grads"]):
            assert equal_lists(g0, g1), key
        assert equal_lists(r0[key]["params"], r1[key]["params"]), key


def test_error_feedback_memory_is_kept_per_parameter(equivalence):
    mem = equivalence[0][("int8", True)]["memory"]
    model = make_model()
    shapes = sorted(p.numel() for p in model.parameters() if p.dim() > 1 and p.numel() >= 1024)
    assert sorted(t.numel() for t in mem["worker_error"].values()) == shapes
    assert any(bool(t.abs().sum() > 0) for t in mem["worker_error"].values())
    # each rank's server memory covers its own chunk only: the ranks' memories are disjoint
    s0 = torch.cat([t for _, t in sorted(equivalence[0][("int8", True)]["memory"]["server_error"].items())])
    s1 = torch.cat([t for _, t in sorted(equivalence[1][("int8", True)]["memory"]["server_error"].items())])
    assert bool(((s0 != 0) & (s1 != 0)).sum() == 0) and bool((s0 != 0).any()) and bool((s1 != 0).any())


def test_stats_count_raw_and_wire_bytes(equivalence):
    model = make_model()
    n = sum(p.numel() for p in model.parameters())
    n_comp = sum(p.numel() for p in model.parameters() if p.dim() > 1 and p.numel() >= 1024)
    steps = 3
    full = equivalence[0][("allreduce", True)]["stats"]
    assert full["raw_bytes"] == 4 * n * steps and full["steps"] == steps
    assert full["wire_bytes"] == 4 * n * steps  # ring allreduce, 2 ranks: 2 (R-1)/R = 1
    half = equivalence[0][("fp16", True)]["stats"]
    assert half["wire_bytes"] == (2 * n_comp + 4 * (n - n_comp)) * steps
    int8 = equivalence[0][("int8", True)]["stats"]
    assert n_comp * steps < int8["wire_bytes"] < 1.1 * (n_comp + 4 * (n - n_comp)) * steps


def test_warmup_steps_use_exact_allreduce(equivalence):
    ref = equivalence[0][("none", False)]
    got = equivalence[0][("int8-warmup", True)]
    assert equal_lists(got["grads"][0], ref["grads"][0]) and equal_lists(got["grads"][1], ref["grads"][1])
    assert not equal_lists(got["grads"][2], ref["grads"][2])


@pytest.mark.parametrize("hook", ALL + PART2)
def test_gradient_as_bucket_view_gives_the_same_bits(modes, hook):
    for rank_out in modes:
        plain, views = rank_out[("grads_in_buckets", hook)]
        assert all(equal_lists(a, b) for a, b in zip(plain["grads"], views["grads"]))
        assert equal_lists(plain["params"], views["params"])


@pytest.mark.parametrize("mode", ["no_sync", "static_graph", "find_unused", "bucket_view"])
@pytest.mark.parametrize("hook", ["fp16", "int8"])
def test_ddp_modes(modes, mode, hook):
    ref = modes[0][(mode, "none")]
    for rank_out in modes:
        got = rank_out[(mode, hook)]
        assert len(got["grads"][0]) == len(ref["grads"][0])
        assert max_rel_err(got["grads"][0], ref["grads"][0]) < REL_TOL[hook]
    assert equal_lists(modes[0][(mode, hook)]["params"], modes[1][(mode, hook)]["params"])


@pytest.mark.parametrize("hook", ALL + PART2)
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_non_finite_gradient_stays_non_finite(modes, hook, value):
    got = modes[0][("inject", hook, value)]
    fc2_weight = 2  # fc1.weight, fc1.bias, fc2.weight, ...
    before, poisoned, after = got["grads"]
    assert all(bool(torch.isfinite(g).all()) for g in before + after)  # the next step is clean again
    assert not bool(torch.isfinite(poisoned[fc2_weight]).all())  # GradScaler will see it
    bad = sum(int((~torch.isfinite(g)).sum()) for g in poisoned)
    # exact formats: only the poisoned element; int8 / onebit: at most its block / chunk (a NaN
    # scale); powersgd: its matrix (a non-finite P)
    assert bad <= {"int8": 256, "onebit": 128, "powersgd": poisoned[fc2_weight].numel()}.get(hook, 1), bad
    for memory in got["memory"].values():  # error feedback is not poisoned
        assert all(bool(torch.isfinite(t).all()) for t in memory.values())


def test_torch_bf16_hook_refuses_on_gloo_while_ours_runs(modes, equivalence):
    assert modes[0]["torch_bf16"] is not None
    assert equivalence[0][("bf16", True)]["stats"]["steps"] == 3


@pytest.mark.parametrize("native", [False, True])
def test_state_round_trip_continues_bit_identically(checkpoint, native):
    for rank_out in checkpoint:
        res = rank_out[native]
        assert equal_lists(res["resumed"], res["full"])
        assert not equal_lists(res["no_memory"], res["full"])  # the memory matters
        assert res["stats"]["steps"] == 6
        assert res["hook_sd"]["memory"]["worker_error"]


def test_loading_another_world_size_warns_and_resets(checkpoint):
    info = checkpoint[0]["world_change"]
    assert any("error-feedback memory is per rank and is reset" in w for w in info["warnings"])
    assert info["memory_count"] > 0 and info["memory_zero"]
    assert info["steps"] == 3  # counters kept


def test_three_ranks(ranks):
    out = ranks.call(world3_worker, 3, timeout=120)
    for rank_out in out:
        for native in (False, True):
            assert equal_lists(rank_out[("allreduce", native)]["params"], rank_out[("none", False)]["params"])
        for hook in ("int8", "fp16"):
            assert equal_lists(rank_out[(hook, False)]["params"], rank_out[(hook, True)]["params"])
    for key in out[0]:
        assert equal_lists(out[0][key]["params"], out[1][key]["params"])
        assert equal_lists(out[0][key]["params"], out[2][key]["params"])
    ref = out[0][("none", False)]["grads"][0]
    assert max_rel_err(out[0][("int8", True)]["grads"][0], ref) < REL_TOL["int8"]


def test_state_dict_of_another_hook_is_refused():
    state, _ = ddpx.comm_hooks.make("int8")
    sd = {"version": 1, "name": "fp16", "counters": torch.zeros(3, dtype=torch.int64), "memory": {}}
    with pytest.raises(DdpxError, match="state dict is for 'fp16', not 'int8'"):
        state.load_state_dict(sd)


def test_register_falls_back_to_python_and_says_why(caplog):
    class NoReducer(torch.nn.Module):
        process_group = None

        def register_comm_hook(self, state, hook):
            self.registered = (state, hook)

    model = NoReducer()
    with caplog.at_level(logging.WARNING, logger="ddpx.comm_hooks"):
        state = ddpx.comm_hooks.register(model, "fp16")
    assert model.registered == (state, ddpx.comm_hooks.hook) and state.native is False
    assert "using the Python hook: NoReducer has no DDP reducer" in caplog.text


@pytest.mark.parametrize("name,options,warned", [("onebit", {}, True), ("onebit", {"min_numel": 1024}, False),
                                                  ("int8", {}, False), ("fp16", {}, False)])
def test_register_says_when_no_parameter_would_be_compressed(caplog, name, options, warned):
    """onebit's default min_numel (16384) exempts every matrix of a 64 x 128 MLP."""
    class SmallDDP(torch.nn.Module):
        process_group = None

        def __init__(self):
            super().__init__()
            self.module = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 10))

        def register_comm_hook(self, state, hook):
            pass

    with caplog.at_level(logging.WARNING, logger="ddpx.comm_hooks"):
        ddpx.comm_hooks.register(SmallDDP(), name, native=False, **options)
    said = "no parameter of this model is compressed (the largest has 8192 elements, min_numel is 16384)"
    assert (said in caplog.text) is warned, caplog.text


# ------------------------------------------------------- netns benchmark
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_comm.py")


def _bench_namespaces(pid):
    import subprocess

    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    prefix = os.environ.get("DDPX_TEST_NETNS", "ddpxbench").split(",")[0]  # as bench_comm.py names them
    return [line for line in out.splitlines() if line.startswith(f"{prefix}{pid}-")]


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not harness.netns_available(tc=True), reason="needs root and ip netns")
def test_bench_comm_runs_in_namespaces_and_cleans_up_even_when_interrupted():
    import json
    import signal
    import subprocess
    import time

    r = subprocess.run([sys.executable, BENCH, "--steps", "1", "--warmup", "1", "--hooks", "int8", "--rate", "10gbit",
                        "--json"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    by = {e["label"]: e for e in res["results"]}
    assert by["ddpx int8 native"]["native"] is True and by["ddpx int8 native"]["ms_per_step"] > 0
    assert by["ddpx int8 native"]["wire_bytes"] < 0.3 * by["no hook"]["wire_bytes"]
    assert "torch powerSGD rank 4" in by  # measured or reported as failed, never missing
    floor = by["DDP only: no-op hook"]  # DDP's own cost: no wire, so its bound is the compute alone
    assert floor["wire_bytes"] == 0 and floor["link_bound_ms"] == floor["compute_ms"] and floor["ms_per_step"] > 0
    # each config's bound: the compute alone measured just before it, plus its wire time at 10 Gbit/s
    int8 = by["ddpx int8 native"]
    assert all(e["compute_ms"] > 0 for e in res["results"])
    assert int8["link_bound_ms"] == pytest.approx(int8["compute_ms"] + int8["wire_bytes"] * 8 / 10e9 * 1e3)
    # SIGTERM while the workers run: the namespaces still go away
    p = subprocess.Popen([sys.executable, BENCH, "--steps", "50", "--hooks", "int8"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not _bench_namespaces(p.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert _bench_namespaces(p.pid), "the benchmark never created its namespaces"
    time.sleep(2)
    inside = [int(pid) for ns in _bench_namespaces(p.pid)
              for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
    assert inside, "no process runs in the namespaces"
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert _bench_namespaces(p.pid) == []
    time.sleep(1)
    alive = [pid for pid in inside if os.path.exists(f"/proc/{pid}") and "zombie" not in
             open(f"/proc/{pid}/status").read().lower()]
    assert alive == [], f"processes left running: {alive}"  # torchrun's workers too, in their own sessions


def test_int8_straight_from_the_bucket_equals_the_packed_path(ranks):
    results = ranks.call(spans_worker, 2, timeout=120)
    for out in results:
        assert all(n > 0 for packed, n in out["spans_seen"] if not packed), out["spans_seen"]
        ref = out[(True, False)]  # packed, Python
        for key in ((False, False), (False, True), (True, True)):
            assert equal_lists(out[key]["grads"][-1], ref["grads"][-1]), key
            assert equal_lists(out[key]["params"], ref["params"]), key
