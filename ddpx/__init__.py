"""ddpx: plugin-based PyTorch DDP training with fused gradient-compression kernels.

Public entry points:
    ddpx.hookimpl        marker for plugin hook implementations
    ddpx.ops             fused kernels (torch ops ``torch.ops.ddpx.*``)
    ddpx.comm_hooks           DDP comm hooks: ``state, hook = ddpx.comm_hooks.make("int8")``
    ddpx.comm            collectives outside DDP (``fused_allreduce``)
"""

import importlib

from .errors import DdpxError
from .version import __version__

from .plugin.markers import hookimpl

_LAZY = {"ops", "hooks", "comm", "data", "trainer", "config"}


def __getattr__(name):
    # Submodules that load the C++ extension or torch.distributed are imported on
    # first use, so `ddpx --version` and plugin discovery stay fast.
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ddpx' has no attribute {name!r}")


__all__ = ["DdpxError", "__version__", "hookimpl", "ops", "hooks", "comm"]
