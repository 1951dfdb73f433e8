"""ddpx: plugin-based PyTorch DDP training with fused gradient-compression kernels.

Public entry points:
    ddpx.fit             train one rank in this process: ``ddpx.fit("cfg.yaml", ["trainer.epochs=3"])``,
                         also in a process group a launcher created (Ray Train, docs/engines.md)
    ddpx.hookimpl        marker for plugin hook implementations
    ddpx.comm_hooks      DDP comm hooks: ``state, hook = ddpx.comm_hooks.make("int8")``
    ddpx.fused_allreduce collectives outside DDP: ``ddpx.fused_allreduce.fused_allreduce``
    ddpx.ops             fused kernels (torch ops ``torch.ops.ddpx.*``)
    ddpx.data, ddpx.models   the built-in digits data and model
    ddpx.config          ``load_config``: the validated config a run uses
"""

import importlib

from .errors import DdpxError
from .plugin.markers import hookimpl
from .version import __version__

_LAZY = {"comm_hooks", "fused_allreduce", "ops", "data", "models", "config"}
_FUNCTIONS = {"fit": "worker"}  # public functions, imported from these modules on first use


def __getattr__(name):
    # Submodules that load the C++ extension or torch.distributed are imported on
    # first use, so `ddpx --version` and plugin discovery stay fast.
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(f".{_FUNCTIONS[name]}", __name__), name)
    raise AttributeError(f"module 'ddpx' has no attribute {name!r}")


__all__ = ["DdpxError", "__version__", "hookimpl", "fit", "comm_hooks", "fused_allreduce", "ops", "data", "models", "config"]
