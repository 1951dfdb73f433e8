"""comm_hook.name fp16 / bf16 / int8 under trainer.strategy: fsdp (ddpx/comm_hooks/reduce_scatter.py):
the reduce-scatter against a plain-torch reference on 2 gloo ranks, bytes, non-finite gradients,
FSDP2 calling it, and what the config accepts and refuses."""

import pytest
import torch
from torch.torch_version import TorchVersion

from ddpx.bench import _reference as reference
from ddpx.comm_hooks import reduce_scatter
from ddpx.config import load_config
from ddpx.strategies.fsdp import MIN_TORCH as FSDP_MIN_TORCH
from ddpx.errors import DdpxError

pytestmark = pytest.mark.skipif(TorchVersion(torch.__version__) < FSDP_MIN_TORCH,
                                reason="trainer.strategy=fsdp needs torch >= 2.8")

N = 203  # elements per rank's chunk: not whole blocks, not whole 4-byte words


def _rank_input(rank, world, n=N):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(world * n, generator=g) * (1 + 10 * torch.rand(world * n, generator=g))


def _expected(name, rank, world, factor, n=N, block=64):
    """Rank ``rank``'s chunk of the reduce-scatter in plain torch: every rank's chunk coded,
    decoded, summed in fp32 in rank order, times ``factor``."""
    chunks = [_rank_input(r, world, n)[rank * n:(rank + 1) * n] for r in range(world)]
    if name == "int8":
        decoded = []
        for chunk in chunks:
            q, scales = reference.int8_quantize(chunk, block)
            decoded.append(reference.int8_dequant_accumulate_(torch.empty(n), q, scales, block))
        total = decoded[0].clone()
        for d in decoded[1:]:
            total += d
        return total * factor
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
    total = reference.scale_cast(chunks[0], factor, dtype).float()
    for chunk in chunks[1:]:
        total += reference.scale_cast(chunk, factor, dtype).float()
    return total


def _make(name, **options):
    """The comm at int8's block 64 (what block_size auto is with AdamW), as the references code."""
    return reduce_scatter.make(name, **({"block_size": 64} if name == "int8" else {}), **options)


def _comm_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    out = {}
    for name in ("int8", "fp16", "bf16"):
        for label, op, factor in (("avg", ReduceOp.AVG, 1 / world), ("sum", ReduceOp.SUM, 1.0),
                                  ("premul", ReduceOp.PREMUL_SUM(0.25), 0.25)):
            comm = _make(name)
            got = torch.full((N,), 7.0)
            comm(got, _rank_input(rank, world), dist.group.WORLD, op)
            want = _expected(name, rank, world, factor)
            # int8's kernel multiplies the fp32 sum by the factor once, as the reference
            out[name, label] = (torch.equal(got, want), (got - want).abs().max().item())
        comm = _make(name)
        got = torch.empty(N)
        comm(got, _rank_input(rank, world), dist.group.WORLD, ReduceOp.PREMUL_SUM(torch.tensor(0.25)))
        out[name, "premul tensor"] = (torch.allclose(got, _expected(name, rank, world, 0.25), rtol=1e-6, atol=0), 0)
        out[name, "stats"] = comm.stats()
        # a NaN in rank 1's gradient, in rank 0's chunk: rank 0's output is non-finite there
        x = _rank_input(rank, world)
        if rank == 1:
            x[5] = float("nan")
            x[N + 70] = float("inf")
        got = torch.empty(N)
        _make(name)(got, x, dist.group.WORLD, ReduceOp.AVG)
        out[name, "nonfinite"] = (~torch.isfinite(got)).nonzero().flatten().tolist()
        try:
            _make(name)(torch.empty(N), _rank_input(rank, world), dist.group.WORLD, ReduceOp.MAX)
        except DdpxError as exc:
            out[name, "max"] = str(exc)
    out["fsdp"] = _fsdp_gradients(rank, world)
    # scope=inter_node with both ranks on one node: an exact fp32 reduce-scatter
    import os

    os.environ.update(GROUP_RANK="0", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    comm = reduce_scatter.make("int8", scope="inter_node")
    got = torch.empty(N)
    comm(got, _rank_input(rank, world), dist.group.WORLD, ReduceOp.AVG)
    chunks = [_rank_input(r, world)[rank * N:(rank + 1) * N] for r in range(world)]
    out["one node"] = (torch.equal(got, (chunks[0] + chunks[1]) * (1 / world)), comm.stats()["wire_bytes"])
    return out


def _fsdp_gradients(rank, world):
    """Gradients of a 2-unit model sharded by FSDP2: the default reduce-scatter vs int8 (block 64)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    grads, calls = {}, None
    for name in ("allreduce", "int8"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        if name == "int8":
            comm = _make("int8")
            units = reduce_scatter.install(model, comm)
        torch.manual_seed(1 + rank)
        model(torch.randn(32, 16)).square().mean().backward()
        grads[name] = torch.cat([p.grad.to_local().flatten() for p in model.parameters()])
        if name == "int8":
            model(torch.randn(32, 16)).square().mean().backward()  # a second step
    stats = comm.stats()
    error = ((grads["int8"] - grads["allreduce"]).norm() / grads["allreduce"].norm()).item()
    return {"units": units, "calls": stats["calls"], "steps": stats["steps"], "relative_error": error}


@pytest.mark.slow
def test_the_compressed_reduce_scatter_equals_the_reference_on_2_ranks(ranks):
    results = ranks.call(_comm_worker, 2, timeout=120)
    for rank, out in enumerate(results):
        for name in ("int8", "fp16", "bf16"):
            for label in ("avg", "sum", "premul"):
                assert out[name, label] == (True, 0.0), (rank, name, label)
            assert out[name, "premul tensor"][0], (rank, name)
            assert out[name, "max"].startswith("ddpx's compressed reduce-scatter sums gradients (AVG, SUM, "
                                               "PREMUL_SUM), not ")
            # each call sends 1 row to the other rank: fp32 would send 4 * N bytes
            row = {"int8": 4 * 4 + 4 * 51, "fp16": 2 * N, "bf16": 2 * N}[name]  # int8: 4 scales + 203 codes, padded
            stats = out[name, "stats"]
            assert (stats["calls"], stats["steps"], stats["raw_bytes"], stats["wire_bytes"],
                    stats["fp32_wire_bytes"]) == (1, 1, 4 * 2 * N, row, 4 * N)
        # int8 at block 64: 1 + 4/64 bytes per element against fp32's 4 (26.6 %; 27.1 % with this N's padding)
        assert out["int8", "stats"]["wire_bytes"] / out["int8", "stats"]["fp32_wire_bytes"] <= 0.30
        # rank 1's NaN at 5 and Inf at N + 70 land in rank 0's and rank 1's chunks
        nonfinite = {0: {"int8": list(range(64)), "fp16": [5], "bf16": [5]},
                     1: {"int8": list(range(64, 128)), "fp16": [70], "bf16": [70]}}[rank]
        for name, where in nonfinite.items():
            assert out[name, "nonfinite"] == where, (rank, name)
        fsdp = out["fsdp"]
        # Linear 0 and the root: one reduce-scatter each per step, 2 steps
        assert (fsdp["units"], fsdp["calls"], fsdp["steps"]) == (2, 4, 2)
        assert 1e-4 < fsdp["relative_error"] < 0.01, fsdp
        assert out["one node"] == (True, 0)  # nothing crossed a node


def _two_nodes_worker(rank, world):
    """4 ranks as 2 nodes x 2 (torchrun's variables): scope=inter_node sums in fp32 inside the
    node, then codes the node sums across nodes; global codes every rank's chunk."""
    import os

    import torch.distributed as dist
    from torch.distributed import ReduceOp

    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    out = {}
    for name in ("int8", "bf16"):
        comm = _make(name, scope="inter_node")
        got = torch.empty(N)
        comm(got, _rank_input(rank, world), dist.group.WORLD, ReduceOp.AVG)
        chunks = [_rank_input(r, world)[rank * N:(rank + 1) * N] for r in range(world)]
        node_sums = [chunks[0] + chunks[1], chunks[2] + chunks[3]]
        if name == "int8":
            decoded = []
            for s in node_sums:
                q, scales = reference.int8_quantize(s, 64)
                decoded.append(reference.int8_dequant_accumulate_(torch.empty(N), q, scales, 64))
        else:
            decoded = [reference.scale_cast(s, 1 / world, torch.bfloat16).float() for s in node_sums]
        want = (decoded[0] + decoded[1]) * (1 / world if name == "int8" else 1.0)
        out[name] = (torch.equal(got, want), (got - want).abs().max().item(), comm.stats()["wire_bytes"])
    return out


@pytest.mark.slow
def test_inter_node_reduces_inside_the_node_in_fp32_and_codes_across_nodes(ranks):
    for rank, out in enumerate(ranks.call(_two_nodes_worker, 4, timeout=120)):
        # across nodes: one row to the other node only (int8: 220 bytes, bf16: 2 N)
        assert out["int8"] == (True, 0.0, 220), rank
        assert out["bf16"] == (True, 0.0, 2 * N), rank


def test_options_are_the_ddp_hooks_and_bad_ones_are_one_line():
    auto, fixed = reduce_scatter.make("int8"), reduce_scatter.make("int8", block_size=128)
    assert (auto.block_size, fixed.block_size) == (256, 128)  # auto before pairing
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
    for comm in (auto, fixed):
        comm.pair(adamw)  # what the comm_hook plugin does at train start: auto becomes 64
    assert (auto.block_size, fixed.block_size) == (64, 128)
    with pytest.raises(DdpxError, match=r"^comm hook 'int8' under trainer.strategy=fsdp: option block_size must "
                                        r"be 'auto' or a positive multiple of 4, got 6$"):
        reduce_scatter.make("int8", block_size=6)
    with pytest.raises(DdpxError, match=r"^comm hook 'int8' under trainer.strategy=fsdp: unknown option\(s\) "
                                        r"min_numel; known options: block_size, scope$"):
        reduce_scatter.make("int8", min_numel=0)
    with pytest.raises(DdpxError, match=r"^comm hook 'bf16' under trainer.strategy=fsdp: unknown option\(s\) "
                                        r"warmup_steps; known options: scope$"):
        reduce_scatter.make("bf16", warmup_steps=10)


def test_a_non_fp32_reduce_dtype_is_refused_by_the_comm():
    comm = reduce_scatter.make("int8")
    with pytest.raises(DdpxError, match=r"^comm hook 'int8' under trainer.strategy=fsdp codes fp32 gradients, its "
                                        r"input is torch.bfloat16: set fsdp.reduce_dtype=fp32$"):
        comm(torch.empty(4, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16), None, None)


@pytest.mark.parametrize("name", ["int8", "fp16", "bf16"])
def test_compressing_hooks_are_accepted_under_fsdp(name):
    config = load_config(None, ["trainer.strategy=fsdp", f"comm_hook.name={name}"])
    assert config.comm_hook.name == name


@pytest.mark.parametrize("overrides, message", [
    (["comm_hook.name=powersgd"], "comm_hook.name=powersgd does not apply under "
                                  "trainer.strategy=fsdp (only bf16, fp16 and int8 have a sharded reduce-scatter); "
                                  "set comm_hook.name=int8 (or bf16, fp16, allreduce)"),
    (["comm_hook.name=onebit"], "comm_hook.name=onebit does not apply under"),
    (["comm_hook.name=onebit_adam", "optimizer.target=ddpx.optim.OneBitAdam"],
     "comm_hook.name=onebit_adam does not apply under"),
    (["comm_hook.name=int8", "fsdp.reduce_dtype=bf16"],
     "comm_hook.name=int8 under trainer.strategy=fsdp codes and sums fp32 gradients itself; "
     "set fsdp.reduce_dtype=fp32 (now bf16), or comm_hook.name=allreduce to reduce-scatter in bf16"),
    (["comm_hook.name=int8", "comm_hook.options={min_numel: 0}"],
     "comm hook 'int8' under trainer.strategy=fsdp: unknown option(s) min_numel; known options: block_size, scope"),
    (["comm_hook.name=int8", "comm_hook.options={scope: inter_node}", "fsdp.shard_size=node"],
     "comm_hook.options.scope=inter_node does not apply under fsdp.shard_size=node (HSDP): the "
     "reduce-scatter runs inside each shard group and the replicas' all-reduce is FSDP's own; remove the scope "
     "option, or set fsdp.shard_size=all"),
])
def test_what_does_not_apply_under_fsdp_is_one_config_error(overrides, message):
    escaped = "".join("\\" + c if c in "().[]{}" else c for c in message)
    with pytest.raises(DdpxError, match="^" + escaped):
        load_config(None, ["trainer.strategy=fsdp", *overrides])


def test_a_torch_without_custom_reduce_scatters_is_refused_in_one_line(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    with pytest.raises(DdpxError, match=r"^comm hook 'int8' under trainer.strategy=fsdp needs "
                                        r"FSDPModule.set_custom_reduce_scatter, which torch 2.8.0 lacks \(2.13 has "
                                        r"it\); upgrade torch, or set comm_hook.name=allreduce$"):
        load_config(None, ["trainer.strategy=fsdp", "comm_hook.name=int8"])
