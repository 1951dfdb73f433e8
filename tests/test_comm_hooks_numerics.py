"""What the comm hooks compute, on gloo (2 and 3 ranks): gradients against DDP
without a hook, the formats' rounding and PowerSGD's reference algorithm; the
native path bit-identical to the Python path; replicas identical; DDP's modes
and non-finite gradients.

The 2-rank scenarios run one after the other in one launch per module (a
fixture), the 3-rank one in another; several tests assert on each scenario's
results, to keep process start-ups few.
"""

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from comm_hook_checks import (ALL, LOSSY, NO_WARMUP, PART2, REL_TOL, DigitsRun, WarningRecords, batch, digits_mlp,
                         equal_lists, make_model, max_rel_err, train)

import ddpx.comm_hooks
from ddpx.comm_hooks.int8 import BLOCK_SIZE
from ddpx.data import digits_split

# the 2-rank scenarios share one launch, set up by whichever test comes first
pytestmark = pytest.mark.timeout(420)

# onebit and powersgd, native against Python: compressing from the first step (the
# defaults warm up with plain allreduce)
NATIVE_CASES = [("onebit", "onebit", {"warmup_steps": 0}),
                ("onebit_all", "onebit", {"compress_vectors": True, "min_numel": 0, "warmup_steps": 0}),
                ("powersgd", "powersgd", {"warmup_steps": 0})]


# ---------------------------------------------------------------- workers
def equivalence_worker(rank, world):
    out = {("none", False): train(None, rank=rank)}
    for hook in ALL:
        for native in (False, True):
            out[(hook, native)] = train(hook, native, rank=rank)
    out[("int8-warmup", True)] = train("int8", True, rank=rank, warmup_steps=2)
    out[("int8-all", True)] = train("int8", True, rank=rank, min_numel=0, compress_vectors=True, block_size=64)
    for native in (False, True):  # block_size auto: 64 from step 0, the state being paired with AdamW
        out[("int8-adamw", native)] = train("int8", native, rank=rank, adamw=True)
    for block, steps in ((64, 1), (256, 1), (64, 3)):  # what the steps send at each block size
        out[("int8-wire", block, steps)] = train("int8", True, steps=steps, rank=rank, block_size=block)
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


def world3_worker(rank, world):
    out = {("none", False): train(None, rank=rank, steps=2)}
    for hook in ("allreduce", "int8", "fp16"):
        for native in (False, True):
            out[(hook, native)] = train(hook, native, rank=rank, steps=2)
    return out


def part2_native_worker(rank, world):
    """onebit and powersgd, 60 steps, native C++ hook vs Python hook: the same numbers.
    onebit_all compresses every parameter: one contiguous stretch, no packing copies."""
    res = {}
    for label, name, opts in NATIVE_CASES:
        py = DigitsRun(rank, world, name, opts, native=False)
        py.steps(0, 60)
        records = WarningRecords()
        logging.getLogger("ddpx.comm_hooks").addHandler(records)
        try:
            nat = DigitsRun(rank, world, name, opts, native=True)
        finally:
            logging.getLogger("ddpx.comm_hooks").removeHandler(records)
        nat.steps(0, 60)
        res[f"{label}_native"] = {"python": py.flat(), "native": nat.flat(), "is_native": nat.state.native,
                                  "warnings": records.messages, "stats": (py.state.stats(), nat.state.stats()),
                                  "direct": [getattr(lay, "direct_offset", None) for lay in py.state.layouts.values()]}
    return res


def _powersgd_steps(rank, world):
    """Five steps of the powersgd hook (rank 2, weights fixed, a new batch each step), with
    every rank's raw gradients (an identical model without DDP, all-gathered) for the
    reference below, and each compressed matrix's seeded starting Q."""
    out = {}
    x_all, y_all = digits_split()[0].tensors
    for native in (False, True):
        model = digits_mlp()
        plain = copy.deepcopy(model)
        ddp = DDP(model, bucket_cap_mb=0.005)
        state = ddpx.comm_hooks.register(ddp, "powersgd", native=native, rank=2, warmup_steps=0)
        hooked, raw = [], []
        for t in range(5):
            lo = (t * world + rank) * 16
            xb, yb = x_all[lo:lo + 16], y_all[lo:lo + 16]
            model.zero_grad()
            torch.nn.functional.cross_entropy(ddp(xb), yb).backward()
            hooked.append([p.grad.clone() for p in model.parameters()])
            plain.zero_grad()
            torch.nn.functional.cross_entropy(plain(xb), yb).backward()
            step = []
            for p in plain.parameters():
                parts = [torch.empty_like(p.grad) for _ in range(world)]
                dist.all_gather(parts, p.grad)
                step.append(parts)
            raw.append(step)
        q0 = {}
        for i, p in enumerate(model.parameters()):
            if state.compressible(p):
                q0[i] = torch.empty(p.shape[1] * state.r_of(p))
                state._draw_q(state.key_of(p), q0[i])
        sd = state.state_dict()
        del sd["memory"]["p"]  # as saved before the hook kept P: its "error" is the error itself
        state.load_state_dict(sd)
        p_after_old_format = all(not t.any() for t in state.memory["p"].values())
        sd["memory"] = {}  # no memory saved: the live memory stays as it is, consistently
        some_p = next(iter(state.memory["p"].values()))
        some_p.fill_(1.0)
        state.load_state_dict(sd)
        out[native] = {"hooked": hooked, "raw": raw, "q0": q0, "p_after_old_format": p_after_old_format,
                       "p_kept": bool((some_p == 1.0).all())}
    return out


def _powersgd_reference(raw, q0, world):
    """PowerSGD as in the paper, fp64, the error written every step: per matrix,
    M = G + E on each rank; P = orthogonalize(sum M Q); Q = mean M^T P; out = P Q^T;
    E = M - out; Q warm-starts the next step. Everything else is averaged."""
    errors, qs, outs = {}, {i: q.double().view(-1, 2) for i, q in q0.items()}, []  # rank 2: Q is m x 2
    for step in raw:
        cur = []
        for i, parts in enumerate(step):
            if i not in qs:
                cur.append(sum(g.double() for g in parts) / world)
                continue
            ms = [g.double() + errors.get((i, w), 0) for w, g in enumerate(parts)]
            p = torch.linalg.qr(sum(m @ qs[i] for m in ms)).Q
            qs[i] = sum(m.t() @ p for m in ms) / world
            approx = p @ qs[i].t()
            for w, m in enumerate(ms):
                errors[(i, w)] = m - approx
            cur.append(approx)
        outs.append(cur)
    return outs


def two_ranks_worker(rank, world):
    """Every 2-rank scenario, one after the other in one launch (modes last: torch's bf16 hook
    fails in it)."""
    return {"equivalence": equivalence_worker(rank, world), "spans": spans_worker(rank, world),
            "powersgd": _powersgd_steps(rank, world), "part2_native": part2_native_worker(rank, world),
            "modes": modes_worker(rank, world)}


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def two_ranks(ranks):
    return ranks.call(two_ranks_worker, 2, timeout=360)


@pytest.fixture(scope="module")
def equivalence(two_ranks):
    return [rank_out["equivalence"] for rank_out in two_ranks]


@pytest.fixture(scope="module")
def modes(two_ranks):
    return [rank_out["modes"] for rank_out in two_ranks]


@pytest.fixture(scope="module")
def part2_native(two_ranks):
    return [rank_out["part2_native"] for rank_out in two_ranks]


# ------------------------------------------------------------------- tests
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


def assert_bit_identical(py, nat):
    assert py["native"] is False and nat["native"] is True
    for g, h in zip(py["grads"], nat["grads"]):
        assert equal_lists(g, h)
    assert equal_lists(py["params"], nat["params"])
    assert py["stats"] == nat["stats"]
    for name in py["memory"]:
        assert py["memory"][name].keys() == nat["memory"][name].keys()
        for k in py["memory"][name]:
            assert torch.equal(py["memory"][name][k], nat["memory"][name][k])


@pytest.mark.parametrize("hook", ALL)
def test_native_and_python_paths_are_bit_identical(equivalence, hook):
    for rank_out in equivalence:
        assert_bit_identical(rank_out[(hook, False)], rank_out[(hook, True)])


def test_int8_block_size_auto_is_64_when_paired_with_adamw(equivalence):
    """``block_size: auto``: pairing the state with AdamW before the first step
    (``state.pair(opt)``) makes every step, the first included, code in blocks of 64, the
    native hook's as the Python one's; SGD keeps 256."""
    for rank_out in equivalence:
        py, nat = rank_out[("int8-adamw", False)], rank_out[("int8-adamw", True)]
        assert_bit_identical(py, nat)
        assert py["blocks"] == nat["blocks"] == [64]
        wire = {key[1:]: v["stats"]["wire_bytes"] for key, v in rank_out.items() if key[0] == "int8-wire"}
        assert py["stats"]["wire_bytes"] == wire[64, 3]  # every step at 64, the first included
        assert wire[64, 1] > wire[256, 1]
        assert rank_out[("int8", True)]["blocks"] == [256]  # SGD


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
    assert bad <= {"int8": BLOCK_SIZE.auto[0], "onebit": 128, "powersgd": poisoned[fc2_weight].numel()}.get(hook, 1), bad
    for memory in got["memory"].values():  # error feedback is not poisoned
        assert all(bool(torch.isfinite(t).all()) for t in memory.values())


def test_torch_bf16_hook_refuses_on_gloo_while_ours_runs(modes, equivalence):
    assert modes[0]["torch_bf16"] is not None
    assert equivalence[0][("bf16", True)]["stats"]["steps"] == 3


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


def test_int8_straight_from_the_bucket_equals_the_packed_path(two_ranks):
    for out in (rank_out["spans"] for rank_out in two_ranks):
        assert all(n > 0 for packed, n in out["spans_seen"] if not packed), out["spans_seen"]
        ref = out[(True, False)]  # packed, Python
        for key in ((False, False), (False, True), (True, True)):
            assert equal_lists(out[key]["grads"][-1], ref["grads"][-1]), key
            assert equal_lists(out[key]["params"], ref["params"]), key


def test_powersgd_matches_the_reference_algorithm(two_ranks):
    """The hook's lazy error (E keeps M; the next step subtracts P' Q'^T) and its
    kernels give PowerSGD's numbers: every step, every parameter, both ranks, both paths."""
    results = [rank_out["powersgd"] for rank_out in two_ranks]
    for native in (False, True):
        ref = _powersgd_reference(results[0][native]["raw"], results[0][native]["q0"], 2)
        assert len(results[0][native]["q0"]) == 3  # all three weight matrices are compressed
        assert results[0][native]["p_after_old_format"] and results[0][native]["p_kept"]
        for r in results:
            for t, (got, want) in enumerate(zip(r[native]["hooked"], ref)):
                assert max_rel_err([g.double() for g in got], want) < 1e-4, (native, t)


@pytest.mark.slow
@pytest.mark.parametrize("label", [c[0] for c in NATIVE_CASES])
def test_native_matches_python(part2_native, label):
    for r in part2_native:
        got = r[f"{label}_native"]
        assert torch.equal(got["python"], got["native"])
        assert got["stats"][0] == got["stats"][1]
        if label == "onebit_all":  # every bucket is compressed in place
            assert got["direct"] and all(d >= 0 for d in got["direct"]), got["direct"]
        assert got["is_native"] and got["warnings"] == []
