"""No ddpx comm-hook executor thread outlives its hook state, its DDP model or its
process group (Python and native paths): a thread left over from an earlier run
in the same process kept CUDA/NCCL resources alive on the GPU machine. One rank,
in this process, over gloo."""

import gc
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx.comm_hooks
import harness
from ddpx.rank import process_group
from ddpx.comm_hooks import executor

HOOKS = ["int8", "powersgd"]  # the multi-phase hooks: they run on an executor thread


def ddpx_threads() -> list[str]:
    """Names of this process's ddpx executor threads, Python ('ddpx-int8-hook') and native ('ddpx-int8')."""
    names = [t.name for t in threading.enumerate() if t.name.startswith("ddpx-")]
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith("ddpx-"):
            names.append(name)
    return names


def wait_for_no_ddpx_threads(seconds: float) -> list[str]:
    harness.wait_for(lambda: not ddpx_threads(), seconds)
    return ddpx_threads()


@pytest.fixture
def group(tmp_path):
    assert not ddpx_threads(), "a ddpx thread was alive before the test"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    process_group.teardown()
    # leave no thread to the next test, whatever this one did
    for t in threading.enumerate():
        if t.name.startswith("ddpx-"):
            t.join(5 * executor.IDLE_CHECK_S)


def trained(name, native):
    """A DDP model with hook `name` that has run two compressed steps."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    ddp = DDP(net, bucket_cap_mb=0.01)
    state = ddpx.comm_hooks.register(ddp, name, native=native, warmup_steps=0, min_numel=0)
    assert state.native is native
    for _ in range(2):
        ddp(torch.randn(8, 64)).sum().backward()
    return ddp, state


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
@pytest.mark.parametrize("name", HOOKS)
def test_executor_ends_with_its_model_and_state(group, name, native):
    ddp, state = trained(name, native)
    assert ddpx_threads(), "the hook's executor thread is not running (or not named ddpx-...)"
    del ddp, state
    gc.collect()
    # before the group goes: the state's finalizer / the reducer's destructor ends it. Where the
    # executor itself held the last reference (the job it just finished), the finalizer ran on the
    # executor, which cannot join itself: it ends right after, so allow a moment, not the idle check
    assert wait_for_no_ddpx_threads(1.0) == []


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_idle_executor_ends_when_its_group_is_destroyed(group, native):
    ddp, state = trained("powersgd", native)  # both kept alive
    assert ddpx_threads()
    dist.destroy_process_group()
    assert wait_for_no_ddpx_threads(5 * executor.IDLE_CHECK_S) == []
    del ddp, state


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_close_ends_the_executor_and_the_hook(group, native):
    ddp, state = trained("int8", native)
    state.close()
    assert ddpx_threads() == []
    with pytest.raises(Exception, match="closed"):
        ddp(torch.randn(8, 64)).sum().backward()
    state.close()  # again: nothing to do
