"""``trainer.sync_batchnorm`` on gloo: each rank's BatchNorm sees the statistics of
the whole global batch, exactly as one BatchNorm over the concatenated batch."""

import pytest
import torch
from torch import nn


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2),
                         nn.BatchNorm1d(2))


def sync_bn_against_one_big_batch(rank, world):
    import torch.distributed as dist

    from ddpx.train.sync_batchnorm import CpuSyncBatchNorm, convert_sync_batchnorm

    torch.manual_seed(1)
    batch = torch.randn(6 * world, 3, 6, 6) * 3 + 1  # the global batch; rank r holds rows 6r..6r+5
    reference, big = model(), batch.clone().requires_grad_()
    reference_out = reference(big)
    reference_out.square().sum().backward()
    rows = slice(6 * rank, 6 * rank + 6)

    ours = convert_sync_batchnorm(model(), torch.device("cpu"))
    assert [type(m) for m in ours.modules()].count(CpuSyncBatchNorm) == 2
    mine = batch[rows].clone().requires_grad_()
    out = ours(mine)
    out.square().sum().backward()
    for p in ours.parameters():
        dist.all_reduce(p.grad)  # the sum over ranks is the big batch's gradient
    return {
        "out": (out.detach(), reference_out[rows].detach()),
        "input_grad": (mine.grad, big.grad[rows]),
        "grads": [(p.grad, q.grad) for p, q in zip(ours.parameters(), reference.parameters())],
        "buffers": [(b, c) for b, c in zip(ours.buffers(), reference.buffers())],
        "eval": (ours.eval()(batch).detach(), reference.eval()(batch).detach()),
    }


@pytest.mark.slow
def test_sync_batchnorm_equals_one_big_batch(ranks):
    for rank, result in enumerate(ranks.call(sync_bn_against_one_big_batch, 2, timeout=60)):
        torch.testing.assert_close(*result["out"], rtol=1e-4, atol=1e-4)
        for ours, reference in result["grads"]:
            torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
        for ours, reference in result["buffers"]:  # running statistics, batches tracked
            torch.testing.assert_close(ours.float(), reference.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(*result["input_grad"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(*result["eval"], rtol=1e-4, atol=1e-4)
