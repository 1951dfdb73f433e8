"""The device mesh of a model-parallel strategy: ``(dp, <dim>)``, data-parallel replicas outside,
the model's ranks (a pipeline's stages, a tensor group) inside.

torchrun numbers a node's ranks consecutively, so the inner dimension (the one that talks every
micro-batch) stays inside a node and the data-parallel dimension, which talks once per step and
can be compressed (``comm_hook.name``), crosses the nodes.
"""

from __future__ import annotations

from ..errors import DdpxError


def model_parallel_mesh(trainer, size: int, dim: str, key: str):
    """A 2-D mesh ``(dp, dim)`` over every rank, ``dim`` of ``size`` consecutive ranks; a world
    size that ``size`` does not divide is a one-line error naming ``key``, on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    world = trainer.world_size
    if world % size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise DdpxError(f"{key}={size} does not divide the {world} ranks into groups of {size}; set {key} to one of "
                        f"{', '.join(map(str, divisors))}, or start a multiple of {size} ranks "
                        "(launch.nproc_per_node x launch.nnodes)")
    return init_device_mesh(trainer.device.type, (world // size, size), mesh_dim_names=("dp", dim))
