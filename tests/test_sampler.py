"""ResumableDistributedBatchSampler and ShardSampler: sharding, shuffling, resume."""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddpx.data.sampler import ResumableDistributedBatchSampler, ShardSampler, shard_range
from ddpx.errors import DdpxError


def make(n, b, w, **kw):
    return [ResumableDistributedBatchSampler(n, b, r, w, **kw) for r in range(w)]


def epoch_batches(samplers):
    """Per rank, the list of batches the sampler yields from its current position."""
    return [list(s) for s in samplers]


def flatten(per_rank):
    return [i for batches in per_rank for batch in batches for i in batch]


SIZES = [(n, b, w) for n in (1, 2, 3, 5, 7, 10, 17, 31, 64, 65, 100) for b in (1, 3, 8) for w in (1, 2, 3, 4)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_shards_disjoint_cover_epoch_and_batch_counts_equal(shuffle):
    for n, b, w in SIZES:
        samplers = make(n, b, w, shuffle=shuffle, seed=3)
        per_rank = epoch_batches(samplers)
        counts = {len(batches) for batches in per_rank}
        assert len(counts) == 1, (n, b, w, counts)  # every rank steps the same number of times
        assert counts == {len(samplers[0])}
        seen = flatten(per_rank)
        assert len(seen) == len(set(seen)), (n, b, w)  # no duplicates
        if n >= w:
            assert sorted(seen) == list(range(n)), (n, b, w)  # nothing dropped
        else:  # fewer samples than ranks: cannot be split without duplicates -> skipped
            assert seen == []
        for batches in per_rank:
            assert all(len(batch) >= 1 for batch in batches), (n, b, w)
        for step in zip(*per_rank):  # ranks' batch sizes differ by at most one
            sizes = [len(batch) for batch in step]
            assert max(sizes) - min(sizes) <= 1


def test_layout_rule_examples():
    # 10 samples, 2 ranks, 3 per rank: one full global batch (6) + tail of 4 split 2/2
    r0, r1 = epoch_batches(make(10, 3, 2, shuffle=False))
    assert r0 == [[0, 1, 2], [6, 7]] and r1 == [[3, 4, 5], [8, 9]]
    # 7 samples, 2 ranks, 3 per rank: tail of 1 < world size is folded into the last batch
    r0, r1 = epoch_batches(make(7, 3, 2, shuffle=False))
    assert r0 == [[0, 1, 2]] and r1 == [[3, 4, 5, 6]]
    # tail of 5 over 3 ranks: 1/2/2
    per_rank = epoch_batches(make(11, 2, 3, shuffle=False))
    assert [b[-1] for b in per_rank] == [[6], [7, 8], [9, 10]]


def test_drop_last_full_batches_only():
    for n, b, w in SIZES:
        samplers = make(n, b, w, drop_last=True)
        per_rank = epoch_batches(samplers)
        steps = n // (w * b)
        assert all(len(batches) == steps for batches in per_rank)
        assert all(len(batch) == b for batches in per_rank for batch in batches)
        seen = flatten(per_rank)
        assert len(seen) == len(set(seen)) == steps * w * b


def test_shuffle_differs_per_epoch_and_is_identical_across_ranks():
    samplers = make(50, 4, 3, seed=7)
    orders = []
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        per_rank_orders = [s.epoch_order() for s in samplers]
        assert all(torch.equal(per_rank_orders[0], o) for o in per_rank_orders)
        # the ranks' batches, interleaved per step, are exactly the global order
        per_rank = epoch_batches(samplers)
        interleaved = [i for step in zip(*per_rank) for batch in step for i in batch]
        assert interleaved == per_rank_orders[0].tolist()
        orders.append(per_rank_orders[0].tolist())
    assert orders[0] != orders[1] != orders[2] != orders[0]
    # reproducible: a new sampler with the same seed gives the same epoch-1 order
    fresh = ResumableDistributedBatchSampler(50, 4, 0, 3, seed=7)
    fresh.set_epoch(1)
    assert fresh.epoch_order().tolist() == orders[1]
    assert ResumableDistributedBatchSampler(50, 4, 0, 3, seed=8).epoch_order().tolist() != orders[0]


def test_consumed_is_a_prefix_of_the_epoch_order():
    samplers = make(23, 2, 3, seed=1)
    for s in samplers:
        s.set_epoch(4)
    order = samplers[0].epoch_order().tolist()
    per_rank = epoch_batches(samplers)
    done = []
    for step in zip(*per_rank):
        done += [i for batch in step for i in batch]
        for s in samplers:
            s.advance()
        assert len({s.consumed for s in samplers}) == 1
        assert sorted(done) == sorted(order[: samplers[0].consumed])
    assert samplers[0].consumed == 23
    with pytest.raises(RuntimeError, match="past the end"):
        samplers[0].advance()


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_at_every_position_with_same_and_other_world_size(drop_last):
    for n, b, w_before, w_after, b_after in itertools.product(
        (13, 40, 41), (2, 5), (1, 2, 3), (1, 2, 4), (2, 3)
    ):
        before = make(n, b, w_before, seed=5, drop_last=drop_last)
        for s in before:
            s.set_epoch(2)
        per_rank = epoch_batches(before)
        num_steps = len(per_rank[0])
        for k in range(num_steps + 1):
            done = [i for step in list(zip(*per_rank))[:k] for batch in step for i in batch]
            probe = make(n, b, w_before, seed=5, drop_last=drop_last)[0]
            probe.set_epoch(2)
            probe.advance(k)
            state = probe.state_dict()
            assert state["consumed"] == len(done)
            # a different seed in the new run's config: the checkpoint's order wins
            after = make(n, b_after, w_after, seed=99, drop_last=drop_last)
            for s in after:
                s.load_state_dict(state)
                s.set_epoch(2)  # the resumed epoch: position kept
            per_rank_rest = epoch_batches(after)
            rest = flatten(per_rank_rest)
            assert [len(s) for s in after] == [len(batches) for batches in per_rank_rest]
            assert len({len(s) for s in after}) == 1
            assert not set(done) & set(rest), (n, b, w_before, w_after, k)
            assert len(rest) == len(set(rest))
            covered = sorted(done + rest)
            if not drop_last:
                skipped = n - len(covered)
                # only a remainder smaller than the new world size may be skipped
                assert skipped == 0 or (skipped < w_after and len(rest) == 0), (n, b, w_after, k)
            else:
                per_step = w_after * b_after
                assert len(rest) == (n - len(done)) // per_step * per_step


def test_state_dict_round_trip_and_set_epoch():
    s = ResumableDistributedBatchSampler(30, 4, 1, 2, seed=11)
    s.set_epoch(3)
    s.advance(2)
    assert s.state_dict() == {"epoch": 3, "consumed": 16, "seed": 11, "num_samples": 30, "world_size": 2}
    s.set_epoch(3)
    assert s.consumed == 16  # same epoch: kept
    assert len(s) == 2  # 14 left: one full global batch of 8 + tail of 6
    s.set_epoch(4)
    assert s.consumed == 0 and len(s) == 4
    with pytest.raises(DdpxError, match="30 training samples|has 31"):
        ResumableDistributedBatchSampler(31, 4, 0, 2).load_state_dict(
            {"epoch": 3, "consumed": 16, "seed": 11, "num_samples": 30, "world_size": 2}
        )


def test_dataloader_uses_the_sampler_lazily():
    data = TensorDataset(torch.arange(20))
    sampler = ResumableDistributedBatchSampler(20, 3, 0, 2, shuffle=False)
    loader = DataLoader(data, batch_sampler=sampler)
    assert len(loader) == 4  # 3 full global batches of 6 + tail of 2 -> 1/1
    got = [batch[0].tolist() for batch in loader]
    assert got == [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18]]
    assert sampler.consumed == 0  # iterating (prefetching) does not move the position


def test_shard_sampler_contiguous_without_padding():
    for n, w in itertools.product(range(0, 30), range(1, 6)):
        shards = [list(ShardSampler(n, r, w)) for r in range(w)]
        assert [i for shard in shards for i in shard] == list(range(n))
        sizes = [len(shard) for shard in shards]
        assert max(sizes) - min(sizes) <= 1
        assert sizes == [len(shard_range(n, r, w)) for r in range(w)]
