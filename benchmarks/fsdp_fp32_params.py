"""A plugin for measurements only: under ``trainer.strategy: fsdp`` with AMP, gather the
parameters in fp32 and leave the casting to ``torch.autocast``, as ddp does
(``MixedPrecisionPolicy(param_dtype=None)``), to tell the mixed-precision policy's
effect from the sharding's (docs/sharded.md#convergence)::

    cd examples/char_gpt
    PYTHONPATH=../../benchmarks ddpx train config.yaml --nproc-per-node 2 trainer.strategy=fsdp \\
        comm_hook.name=allreduce 'plugins.enable=[fsdp_fp32_params]'

Importing it patches ``ddpx.train.fsdp.mixed_precision`` in that process."""

from torch.distributed.fsdp import MixedPrecisionPolicy

from ddpx import hookimpl
from ddpx.train import fsdp

_policy = fsdp.mixed_precision


def _fp32_params(config):
    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=_policy(config).reduce_dtype)


fsdp.mixed_precision = _fp32_params


@hookimpl
def ddpx_train_start(trainer):
    trainer.log.info("fsdp_fp32_params: fsdp gathers fp32 parameters; autocast casts, as under ddp")
