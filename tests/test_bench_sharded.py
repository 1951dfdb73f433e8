"""benchmarks/bench_sharded.py's arithmetic (per-step figures from the shard_memory plugin's
record, the gradients' bytes on the wire) and its cells' configs; the 2-host run itself
needs root and minutes (docs/sharded.md, "What it costs")."""

import argparse

import pytest

import harness

bench = harness.benchmark("bench_sharded")
shard_memory = harness.benchmark("shard_memory")

ARGS = argparse.Namespace(width=128, layers=2, batch=4, warmup=2, steps=3)


def test_per_step_figures_are_taken_after_the_warmup_steps():
    record = {"parameters": 40, "gradients": 40, "optimizer": 80, "total": 160, "world_size": 2,
              "peak_rss_bytes": 7, "rss_bytes": 5,
              # 5 steps: the first two are warm-up; the timed ones take 1.0, 3.0 and 2.0 s
              "step_end_s": [0.0, 10.0, 11.0, 14.0, 16.0], "sent_bytes": [0, 500, 800, 1100, 1400],
              "hook_first": {"wire_bytes": 100, "fp32_wire_bytes": 400, "steps": 1},
              "hook_last": {"wire_bytes": 500, "fp32_wire_bytes": 2000, "steps": 5}}
    out = bench.measure(record, warmup=2)
    assert out["ms_per_step"] == 2000.0
    assert out["sent_bytes_per_step"] == 300.0  # (1400 - 500) / 3: from the end of the last warm-up step
    assert out["hook_wire_bytes_per_step"] == 100.0  # the counter over its last 4 steps
    assert out["hook_fp32_wire_bytes_per_step"] == 400.0
    assert out["total"] == 160 and out["peak_rss_bytes"] == 7 and out["rss_bytes"] == 5


def test_gradient_bytes_ring_formulas_and_the_counter_first():
    grads = 8e6  # fp32 gradients
    assert bench.reduce_bytes("ddp", {}, grads, world=4) == 2 * 3 / 4 * grads  # all-reduce
    assert bench.reduce_bytes("fsdp", {}, grads, world=4) == 3 / 4 * grads  # reduce-scatter
    assert bench.reduce_bytes("fsdp_reduce_bf16", {}, grads, world=4) == 3 / 8 * grads
    assert bench.reduce_bytes("fsdp_int8", {"hook_wire_bytes_per_step": 123.0}, grads, world=4) == 123.0


def test_sent_bytes_leaves_loopback_out(tmp_path):
    table = tmp_path / "dev"
    table.write_text(
        "Inter-|   Receive                                                |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n"
        "    lo: 9000 10 0 0 0 0 0 0 9000 10 0 0 0 0 0 0\n"
        "vt1a2b3ca: 111 2 0 0 0 0 0 0 4321 7 0 0 0 0 0 0\n"
        "  eth1: 5 1 0 0 0 0 0 0 79 1 0 0 0 0 0 0\n")
    assert shard_memory.sent_bytes(str(table)) == 4321 + 79
    assert shard_memory.sent_bytes(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("cell", ["ddp", "fsdp", "fsdp_reduce_bf16", "fsdp_int8", "fsdp_bf16"])
def test_the_cells_configs_load(cell):
    """Every override is a key of the char GPT example's config (load_config checks them)."""
    assert bench.refusal(cell, ARGS) is None


def test_summary_ratios_to_ddp_within_each_round_and_the_counters_fraction():
    def cell(ms, total, **extra):
        return {"parameters": total / 4, "gradients": total / 4, "optimizer": total / 2, "total": total,
                "world_size": 2, "peak_rss_bytes": 10, "ms_per_step": ms, "sent_bytes_per_step": 1e6, **extra}

    rounds = [{"ddp": cell(100.0, 800), "fsdp_int8": cell(150.0, 400, hook_wire_bytes_per_step=26.0,
                                                           hook_fp32_wire_bytes_per_step=100.0)},
              {"ddp": cell(200.0, 800), "fsdp_int8": cell(260.0, 400, hook_wire_bytes_per_step=26.0,
                                                           hook_fp32_wire_bytes_per_step=100.0)}]
    s = bench.summarize(rounds, ["ddp", "fsdp_int8"], rate_bps=1e9)
    assert s["fsdp_int8"]["vs_ddp"] == pytest.approx((1.5 + 1.3) / 2)  # each round's own ddp
    assert s["fsdp_int8"]["memory_vs_ddp"] == 0.5
    assert s["fsdp_int8"]["reduce_vs_fp32"] == 0.26 and s["fsdp_int8"]["reduce_source"] == "counter"
    assert s["ddp"]["reduce_vs_fp32"] == 2.0  # an all-reduce sends twice a reduce-scatter
    assert s["ddp"]["link_ms"] == 8.0  # 1 MB at 1 Gbit/s
