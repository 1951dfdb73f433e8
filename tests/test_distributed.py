"""ddpx.rank.process_group in this process (a group of one over gloo): the teardown every
run ends with."""

import gc
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpx.rank import process_group


def test_teardown_frees_a_model_left_in_a_reference_cycle_before_its_group(tmp_path):
    """A DDP model that only a reference cycle still holds (a closure, a plugin that
    points back at it) goes while its process group exists: the reducer must not
    outlive the group."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    group_alive_when_freed = []
    gc.disable()  # no automatic collection: only teardown's may find the cycle
    try:
        ddp = DDP(torch.nn.Linear(4, 4))
        cycle = [ddp]
        cycle.append(cycle)
        weakref.finalize(ddp, lambda: group_alive_when_freed.append(dist.is_initialized()))
        del ddp, cycle
        assert group_alive_when_freed == []  # the cycle keeps it
        process_group.teardown()
        assert not dist.is_initialized()
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert group_alive_when_freed == [True]
    process_group.teardown()  # a second call does nothing
