"""What DDP says about a model, told as parameter names: a model that differs between ranks
(checked before DDP wraps it), and parameters that got no gradient in a step.

A model built differently on some rank (a size read from ``RANK``, a file that
differs between hosts) makes DDP's constructor fail with "params[0] in this
process with sizes [32, 64] appears not to match": :func:`check_same_model`
compares names, shapes and dtypes first and names the first difference on
each rank.

DDP all-reduces a gradient bucket once every parameter in it has its gradient. A
forward that skips a submodule on some batches (a mixture of experts, an
``if``) leaves those parameters without one: the bucket is never reduced, the
other ranks wait for it, and the next forward on this rank raises torch's
generic 90-line "Expected to have finished reduction in the prior iteration"
with parameter *indices*. :func:`explain` turns it into one line.
"""

from __future__ import annotations

import re
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import DdpxError, RanksDisagree
from ..rank.process_group import first_disagreement

UNFINISHED = "Expected to have finished reduction in the prior iteration"
INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")
NAMES = re.compile(r"Parameters which did not receive grad for rank (\d+): ([^\n]+)")  # TORCH_DISTRIBUTED_DEBUG
SHOWN = 6  # names in the message; the rest are counted
# The per-step cost of find_unused_parameters (an extra traversal of the autograd graph after each
# forward), measured on 2 gloo ranks on CPU with benchmarks/bench_find_unused.py (docs/troubleshooting.md).
COST = "+25 % per step on the digits MLP, +1 % on the char GPT example"


class UnusedParameters(DdpxError):
    """Some parameters got no gradient in a step, so DDP could not finish its all-reduce."""


def check_same_model(module: torch.nn.Module) -> None:
    """Raise :class:`RanksDisagree` on every rank when ranks built different models (parameter and
    buffer names, shapes, dtypes). One small all_gather at start; a second one only on a difference."""
    tensors = [*module.named_parameters(), *(("buffer " + n, b) for n, b in module.named_buffers())]
    layout = [f"{name} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for name, t in tensors]
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, zlib.crc32("\n".join(layout).encode()))
    if len(set(digests)) == 1:
        return
    layouts: list = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout)
    differs = first_disagreement(layouts)
    if differs is None:  # the same layouts after all
        return
    rank, i, mine, first = differs
    raise RanksDisagree(
        f"the model differs between ranks: tensor {i} is {mine} on rank {rank} but {first} on rank 0 "
        f"({len(layouts[rank])} and {len(layouts[0])} tensors); build it the same way on every rank (a size read "
        "from RANK, or a file or package version that differs between hosts?)")


def reducer_parameter_names(ddp: torch.nn.Module) -> list[str]:
    """The names of the parameters DDP reduces, in the reducer's order (the indices in its errors)."""
    ignored = getattr(ddp, "parameters_to_ignore", ())
    return [name for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored]


def explain_unused(exc: BaseException, ddp, step: int) -> Optional[UnusedParameters]:
    """The one-line error for DDP's unfinished-reduction error ``exc`` on this rank (None for any
    other error). ``step``: the optimizer steps done, the last of which left the parameters without
    a gradient."""
    text = str(exc)
    if UNFINISHED not in text or not hasattr(ddp, "module"):
        return None
    named = NAMES.search(text)
    found = INDICES.search(text)
    total = reducer_parameter_names(ddp)
    if named:
        names = [n.strip() for n in named.group(2).split(",") if n.strip()]
    elif found:
        names = [total[int(i)] if int(i) < len(total) else f"#{i}" for i in found.group(2).split()]
    else:
        names = []
    listed = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    which = f"{listed} ({len(names)} of {len(total)} parameters)" if names else "some parameters"
    static = ("; with trainer.static_graph: true the set of used parameters must not change between steps"
              if getattr(ddp, "static_graph", False) else "")
    return UnusedParameters(
        f"{which} got no gradient in step {step}, so DDP could not finish that step's "
        f"all-reduce; set trainer.find_unused_parameters: true (costs {COST}), or make every step's "
        f"forward use them{static}")
