"""Comm-hook state across checkpoints, on gloo (2 ranks): a ``state_dict()`` round
trip continues bit-identically (int8, onebit, powersgd; Python and native) and the
error-feedback memory matters; a state saved at another world size warns and
resets the memory, keeping the counters; another hook's state is refused.
"""

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from comm_hook_checks import PART2, DigitsRun, WarningRecords, batch, equal_lists, make_model, train

import ddpx.comm_hooks
from ddpx.errors import DdpxError


# ---------------------------------------------------------------- workers
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


def part2_round_trip_worker(rank, world):
    res = {}
    # round trip: save at step 30 (compressing, past the bucket rebuild), continue to 60. One
    # bucket, so the resumed run's first iteration (before DDP's rebuild) has the same layout.
    for name in PART2:
        opts = {"warmup_steps": 0}  # compressing from the first step
        run = DigitsRun(rank, world, name, opts, bucket_cap_mb=25)
        run.steps(0, 30)
        snap = run.snapshot()
        run.steps(30, 60)
        resumed = DigitsRun(rank, world, name, opts, bucket_cap_mb=25)
        resumed.restore(snap)
        resumed.steps(30, 60)
        cold = DigitsRun(rank, world, name, opts, bucket_cap_mb=25)  # hook memory lost
        cold.restore(snap, hook=False)
        cold.steps(30, 60)
        memory = {k: sum(float(t.abs().sum()) for t in d.values()) for k, d in snap["hook"]["memory"].items()}
        res[f"{name}_roundtrip"] = {"uninterrupted": run.flat(), "resumed": resumed.flat(), "cold": cold.flat(),
                                    "saved_memory": memory, "steps": (run.state.steps, resumed.state.steps)}

        # loading into a group of another size warns and resets the memory
        groups = [dist.new_group([r]) for r in range(world)]
        records = WarningRecords()
        logging.getLogger("ddpx.comm_hooks").addHandler(records)
        try:
            single, _ = ddpx.comm_hooks.make(name, process_group=groups[rank], **opts)
            single.load_state_dict(snap["hook"])
        finally:
            logging.getLogger("ddpx.comm_hooks").removeHandler(records)
        res[f"{name}_resize"] = {"warnings": records.messages, "steps": single.steps,
                                 "memory": {k: sum(float(t.abs().sum()) for t in d.values())
                                            for k, d in single.memory.items() if k != "q"}}
    return res


def two_ranks_worker(rank, world):
    """Both scenarios, one after the other in one launch."""
    return {"checkpoint": checkpoint_worker(rank, world), "part2": part2_round_trip_worker(rank, world)}


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def two_ranks(ranks):
    return ranks.call(two_ranks_worker, 2, timeout=280)


@pytest.fixture(scope="module")
def checkpoint(two_ranks):
    return [rank_out["checkpoint"] for rank_out in two_ranks]


@pytest.fixture(scope="module")
def part2_round_trips(two_ranks):
    return [rank_out["part2"] for rank_out in two_ranks]


# ------------------------------------------------------------------- tests
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


def test_state_dict_of_another_hook_is_refused():
    state, _ = ddpx.comm_hooks.make("int8")
    sd = {"version": 1, "name": "fp16", "counters": torch.zeros(3, dtype=torch.int64), "memory": {}}
    with pytest.raises(DdpxError, match="state dict is for 'fp16', not 'int8'"):
        state.load_state_dict(sd)


@pytest.mark.slow
@pytest.mark.parametrize("name", PART2)
def test_state_round_trip(part2_round_trips, name):
    for r in part2_round_trips:
        rt = r[f"{name}_roundtrip"]
        assert all(v > 0 for v in rt["saved_memory"].values()), rt["saved_memory"]
        assert torch.equal(rt["uninterrupted"], rt["resumed"])
        assert not torch.equal(rt["uninterrupted"], rt["cold"])  # the memory matters
        assert rt["steps"] == (60, 60)


@pytest.mark.slow
@pytest.mark.parametrize("name", PART2)
def test_world_size_change_on_load_warns_and_resets(part2_round_trips, name):
    for r in part2_round_trips:
        rs = r[f"{name}_resize"]
        assert any("reset" in m for m in rs["warnings"]), rs["warnings"]
        assert all(v == 0 for v in rs["memory"].values()), rs["memory"]
        assert rs["steps"] == 30
