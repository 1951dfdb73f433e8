"""Every comm hook on CUDA tensors over NCCL (one GPU: a world of one rank).

With one rank every collective returns its input, so the hooks' device code is
what is checked: the CUDA kernels, the NCCL calls of both phases, the native
C++ path. The same worker runs on the CPU over gloo in
``test_device_worker_on_cpu``, so its logic is checked on every machine.
"""

from __future__ import annotations

import pytest
import torch

from comm_hook_checks import ALL, PART2, REL_TOL, equal_lists, max_rel_err

HOOKS = ALL + PART2


def device_worker(rank, world, device, backend):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx.comm_hooks

    group = dist.new_group(ranks=list(range(world)), backend=backend)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 256, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(device)

    def grads(hook, native):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(device)
        # the hook's own DDP options, but small buckets: several in flight
        options = {**(ddpx.comm_hooks.ddp_options(hook) if hook else {}), "bucket_cap_mb": 0.2}
        ddp = DDP(net, device_ids=[torch.device(device)] if device != "cpu" else None, process_group=group, **options)
        # compress from the first step (onebit and powersgd warm up by default)
        warm = {"warmup_steps": 0} if hook in ("onebit", "powersgd") else {}
        state = ddpx.comm_hooks.register(ddp, hook, native=native, **warm) if hook else None
        out = []
        for _ in range(3):
            ddp.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            out.append([p.grad.detach().cpu().clone() for p in net.parameters()])
        return out, state.native if state else None

    results = {"none": grads(None, False)[0]}
    for hook in HOOKS:
        for native in (False, True):
            results[(hook, native)] = grads(hook, native)
    return results


def _check(results, device):
    ref = results["none"]
    for hook in HOOKS:
        python, native = results[(hook, False)], results[(hook, True)]
        assert native[1] is True, f"{hook}: the native hook did not register on {device}"
        for a, b in zip(python[0], native[0]):  # native and Python paths: the same bits
            assert equal_lists(a, b), hook
        for step in python[0]:
            assert all(bool(torch.isfinite(t).all()) for t in step), hook
        if hook == "allreduce":  # one rank: the average is the rank's own gradient, exactly
            assert equal_lists(python[0][0], ref[0])
        elif hook in REL_TOL:  # ... up to the format
            assert max_rel_err(python[0][0], ref[0]) < REL_TOL[hook], hook


def test_device_worker_on_cpu(ranks):
    _check(ranks.call(device_worker, 1, args=("cpu", "gloo"), timeout=120)[0], "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                    reason="needs a CUDA device and NCCL")
def test_every_hook_on_cuda_over_nccl(ranks):
    _check(ranks.call(device_worker, 1, args=("cuda", "nccl"), timeout=300)[0], "cuda")
