"""``trainer.compile``: ``torch.compile`` of the DDP-wrapped model (or of the FSDP2-sharded one,
whose hooks dynamo skips: graph breaks at each unit), with one-line errors where it cannot work."""

from __future__ import annotations

import os
import sys

import torch
import torch.utils._pytree as pytree

from ..errors import DdpxError


# trainer.compile_dynamic -> torch.compile's `dynamic`; "batch" marks dim 0 of the inputs itself
COMPILE_DYNAMIC = {"batch": None, "auto": None, "static": False, "all": True}


def compile_model(model: torch.nn.Module, backend, device: torch.device, dynamic: str = "batch") -> torch.nn.Module:
    """``trainer.compile``: ``torch.compile`` of the DDP-wrapped model, torch's DDP-aware
    path (graphs split at bucket boundaries so communication overlaps the backward);
    the comm hook registered on the DDP model stays in charge of communication.
    ``backend``: true for inductor, or a torch.compile backend name. ``dynamic``
    (``trainer.compile_dynamic``): ``batch`` compiles the batch dimension (dim 0 of every
    input tensor) as dynamic from the first call, so the epoch's short last batch runs
    the same graph; ``auto``, ``static``, ``all`` are torch.compile's ``dynamic=None``,
    ``False``, ``True``. Where it cannot work, a one-line error before training."""
    backend = "inductor" if backend is True else backend
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise DdpxError(f"trainer.compile: torch.compile does not support Python {sys.version.split()[0]} with torch "
                        f"{torch.__version__}; set trainer.compile=false")
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise DdpxError(f"trainer.compile: unknown backend {backend!r}; use true (inductor) or one of "
                        f"{', '.join(torch._dynamo.list_backends())}")
    if dynamic not in COMPILE_DYNAMIC:
        raise DdpxError(f"trainer.compile_dynamic must be one of {', '.join(COMPILE_DYNAMIC)}, got {dynamic!r}")
    if backend == "inductor" and device.type == "cpu":
        import shutil

        compilers = [os.environ.get("CXX"), "g++", "c++", "clang++"]
        if not any(c and shutil.which(c) for c in compilers):
            raise DdpxError("trainer.compile: inductor on CPU needs a C++ compiler (none found: install g++ or set CXX); "
                            "or set trainer.compile=false")
    if backend == "inductor" and device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise DdpxError("trainer.compile: inductor on CUDA needs triton (pip install triton); or set trainer.compile=false")
    compiled = torch.compile(model, backend=backend, dynamic=COMPILE_DYNAMIC[dynamic])
    if dynamic == "batch":
        # before each call, outside the compiled code (the wrapper's own hook)
        compiled.register_forward_pre_hook(_mark_batch_dynamic, with_kwargs=True)
    return compiled


def _mark_batch_dynamic(module, args, kwargs):
    """Dim 0 of every input tensor is the batch: compile it as a symbol, not a constant
    (``maybe``: a model that needs it fixed still compiles, with a recompile per size)."""
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(t, 0)
