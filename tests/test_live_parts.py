"""Live recovery's parts without processes: the sampler's layout over the groups, the codecs'
averages across groups (threads stand in for the groups), and the one-line refusals."""

import threading

import pytest
import torch

from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.recovery.codecs import CODECS
from ddpx.recovery.sampler import LiveBatchSampler


def test_committed_steps_train_every_sample_of_an_epoch_once_whatever_the_groups_do():
    """Groups come and go and steps are dropped; the committed steps' samples are the epoch."""
    n, batch, ranks = 1000, 7, 2
    samplers = {}
    trained = []
    plan = [3, 3, 2, 2, 2, 4, 1, 1, 3]  # groups per step, repeated; a step of 4 groups is dropped
    step = 0
    while True:
        groups = plan[step % len(plan)]
        slots = groups * ranks
        batches = []
        for slot in range(slots):
            sampler = samplers.setdefault(slot, LiveBatchSampler(n, batch, 0, 1, seed=3))
            sampler.consumed = samplers[0].consumed  # a healed group takes the position with the state
            sampler.place(slot, slots)
            batches.append(next(iter(sampler), None))
        step += 1
        if batches[0] is None:
            break
        if groups == 4:
            continue  # dropped: nothing moves
        trained += [i for b in batches for i in b]
        for slot in range(slots):
            samplers[slot].commit(1)
        for slot, sampler in samplers.items():
            sampler.consumed = samplers[0].consumed
    assert sorted(trained) == list(range(n))


def test_the_sampler_plugins_advance_leaves_the_position_to_commits():
    sampler = LiveBatchSampler(100, 10, 0, 2)
    sampler.advance(3)
    assert sampler.consumed == 0
    sampler.commit(2)
    assert sampler.consumed == 40


class ThreadGroups:
    """``groups`` threads, each a replica group's ``Across``: sum, all-to-all and all-gather over
    shared buffers with a barrier."""

    def __init__(self, groups):
        self.groups, self.barrier, self.slots = groups, threading.Barrier(groups), [None] * groups

    def across(self, rank):
        shared = self

        class Manager:
            def errored(self):
                return None

        class Across:
            groups, manager = shared.groups, Manager()

            def __init__(self):
                self.rank = rank

            def _share(self, tensor):
                shared.slots[rank] = tensor.clone()
                shared.barrier.wait()
                parts = list(shared.slots)
                shared.barrier.wait()
                return parts

            def sum(self, tensor):
                tensor.copy_(sum(self._share(tensor)))
                return True

            def all_to_all(self, output, input):
                parts = self._share(input)
                rows = [p.view(shared.groups, -1)[rank] for p in parts]
                output.view(shared.groups, -1).copy_(torch.stack(rows))
                return True

            def all_gather(self, output, input):
                output.copy_(torch.cat(self._share(input)))
                return True

        return Across()

    def run(self, fn):
        results = [None] * self.groups
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, fn(r, self.across(r))))
                   for r in range(self.groups)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return results


@pytest.mark.parametrize("name,tolerance", [("allreduce", 1e-6), ("fp16", 2e-3), ("bf16", 2e-2), ("int8", 2e-2)])
def test_each_codec_averages_the_gradients_of_the_groups(name, tolerance):
    torch.manual_seed(0)
    grads = [torch.randn(5000) for _ in range(3)]
    mean = torch.stack(grads).mean(0)
    codecs = [CODECS[name].cls({}) for _ in grads]

    def average(rank, across):
        flat = grads[rank].clone()
        assert codecs[rank].exchange(flat, across)
        return flat

    results = ThreadGroups(3).run(average)
    for out in results:
        assert (out - mean).abs().max() / mean.abs().max() < tolerance
    assert all(torch.equal(results[0], out) for out in results)  # every group steps with the same gradient
    stats = codecs[0].stats()
    less = {"allreduce": 1.0, "fp16": 2.0, "bf16": 2.0, "int8": 4 / (1 + 4 / 64)}[name]  # block_size auto, unpaired: 64
    assert stats["fp32_wire_bytes"] / stats["wire_bytes"] == pytest.approx(less, rel=1e-3)


def test_int8_error_feedback_repays_what_a_step_rounded_away():
    torch.manual_seed(1)
    grads = [torch.randn(4096) for _ in range(2)]
    codecs = [CODECS["int8"].cls({"block_size": 256}) for _ in grads]
    sums = [torch.zeros(4096) for _ in grads]

    def steps(rank, across):
        for _ in range(20):
            flat = grads[rank].clone()
            codecs[rank].exchange(flat, across)
            sums[rank] += flat
        return sums[rank]

    total = ThreadGroups(2).run(steps)[0]
    exact = 20 * torch.stack(grads).mean(0)
    one_step = torch.stack(grads).mean(0)
    assert (total - exact).abs().max() < 0.05 * one_step.abs().max()  # the error does not grow with the steps


@pytest.mark.parametrize("override,message", [
    ("trainer.strategy=fsdp", "elastic.recovery=live supports trainer.strategy=ddp, not fsdp"),
    ("comm_hook.name=onebit", "comm_hook.name=onebit cannot cross replica groups"),
    ("comm_hook.name=powersgd", "comm_hook.name=powersgd cannot cross replica groups"),
])
def test_what_live_recovery_cannot_run_is_one_line(override, message):
    with pytest.raises(DdpxError, match=message):
        load_config(None, ["elastic.recovery=live", "elastic.lighthouse=127.0.0.1:29510", override])


def test_a_codec_option_that_does_not_apply_across_groups_is_one_line():
    with pytest.raises(DdpxError, match=r"comm_hook.options rank do not apply to int8 across replica groups"):
        load_config(None, ["elastic.recovery=live", "comm_hook.name=int8", "comm_hook.options={rank: 4}"])
    load_config(None, ["elastic.recovery=live", "comm_hook.name=int8", "comm_hook.options={block_size: 128}"])
