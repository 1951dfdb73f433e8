"""The two-phase pipeline (ddpx/comm_hooks/twophase.py): the fixed order its
collectives start in, a failure kept to its own bucket, pieces run on across
buckets, and several buckets in flight on gloo (where torch 2.13's powerSGD_hook
fails)."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx.comm_hooks


def _many_buckets(rank, world):
    """Five steps of an 8 x Linear(512, 512) model in 1 MB buckets (several in flight)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    ddp = DDP(model, bucket_cap_mb=1)
    ddpx.comm_hooks.register(ddp, "powersgd", native=False, rank=4, warmup_steps=2)
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(rank))
    for _ in range(5):
        model.zero_grad()
        ddp(x).square().mean().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return {"grads": grads, "buckets": len(ddp.reducer._get_zeros_like_grad_buckets())}


@pytest.mark.slow
def test_powersgd_runs_with_several_buckets_on_gloo(ranks):
    """Where torch's own powerSGD_hook fails on gloo with several buckets (a rank left
    waiting; benchmarks/bench_comm.py reports it as FAILED in its table)."""
    ours = ranks.call(_many_buckets, world_size=2, timeout=90)
    assert ours[0]["buckets"] >= 3
    assert torch.equal(ours[0]["grads"], ours[1]["grads"])
    assert torch.isfinite(ours[0]["grads"]).all()


class _Lay:
    """A bucket layout with `pieces` pieces, named "<bucket>" or "<bucket>.<piece>"."""

    def __init__(self, bucket, pieces=1):
        from ddpx.comm_hooks.twophase import Piece

        self.pieces = [Piece(j, pieces, name=f"{bucket}" if pieces == 1 else f"{bucket}.{j}") for j in range(pieces)]


class _RecordingPipeline:
    """TwoPhaseState's pipeline over fake collectives: records the issue order."""

    def __new__(cls, fail_reduce_of=None):
        from ddpx.comm_hooks.twophase import TwoPhaseState

        class Recording(TwoPhaseState):
            def start_phase1(self, buf, lay, pc):
                self.log.append(f"A2A {pc.name}")
                return f"a2a {pc.name}"

            def start_phase2(self, buf, lay, pc, exchange):
                assert exchange == f"a2a {pc.name}"
                if pc.name == fail_reduce_of:
                    raise RuntimeError(f"reduce {pc.name} failed")
                self.log.append(f"AG {pc.name}")
                return f"ag {pc.name}"

            def finish(self, buf, lay, pc, gather):
                assert gather == f"ag {pc.name}"
                self.log.append(f"finish {pc.name}")

        state = object.__new__(Recording)  # only the pipeline: no group, no executor
        state._advancing, state._finishing = None, []  # what TwoPhaseState.__init__ sets
        state.log = []
        return state


def test_two_phase_pipeline_order_and_failures():
    """Collectives start in one fixed order (A2A 0, A2A 1, AG 0, A2A 2, AG 1, AG 2), the
    last job starts its own all-gather before decoding what is left, and a failed bucket
    fails only its own future."""
    state = _RecordingPipeline()
    futures = [torch.futures.Future() for _ in range(3)]
    for i, fut in enumerate(futures):
        state._pipeline(torch.full((2,), float(i)), _Lay(i), i == 2, fut)
    assert state.log == ["A2A 0", "A2A 1", "AG 0", "A2A 2", "AG 1", "AG 2", "finish 0", "finish 1", "finish 2"]
    assert [f.value()[0].item() for f in futures] == [0.0, 1.0, 2.0]

    state = _RecordingPipeline(fail_reduce_of="1")
    futures = [torch.futures.Future() for _ in range(3)]
    for i, fut in enumerate(futures):
        state._pipeline(torch.zeros(1), _Lay(i), i == 2, fut)
    assert all(f.done() for f in futures)
    with pytest.raises(RuntimeError, match="reduce 1 failed"):
        futures[1].wait()
    assert futures[0].value() is not None and futures[2].value() is not None
    assert state._advancing is None and state._finishing == []  # nothing left for the next step


def test_two_phase_pipeline_runs_pieces_across_buckets():
    """A bucket of 3 pieces: the pipeline runs piece by piece, on into the next bucket;
    the bucket's future completes only with its last piece; a failed piece fails its
    bucket only."""
    state = _RecordingPipeline()
    futures = [torch.futures.Future() for _ in range(2)]
    done_after_first = []
    for i, (fut, lay) in enumerate(zip(futures, [_Lay(0, 3), _Lay(1, 2)])):
        state._pipeline(torch.full((1,), float(i)), lay, i == 1, fut)
        done_after_first.append(fut.done())
    assert state.log == ["A2A 0.0", "A2A 0.1", "AG 0.0", "A2A 0.2", "AG 0.1", "finish 0.0",
                         "A2A 1.0", "AG 0.2", "finish 0.1", "A2A 1.1", "AG 1.0", "AG 1.1", "finish 0.2",
                         "finish 1.0", "finish 1.1"]
    assert done_after_first == [False, True]  # bucket 0's last piece is finished by bucket 1's job
    assert [f.value()[0].item() for f in futures] == [0.0, 1.0]

    state = _RecordingPipeline(fail_reduce_of="0.1")
    futures = [torch.futures.Future() for _ in range(2)]
    for i, (fut, lay) in enumerate(zip(futures, [_Lay(0, 3), _Lay(1, 2)])):
        state._pipeline(torch.zeros(1), lay, i == 1, fut)
    with pytest.raises(RuntimeError, match="reduce 0.1 failed"):
        futures[0].wait()
    assert futures[1].value() is not None
    assert state._advancing is None and state._finishing == []  # nothing left for the next step
