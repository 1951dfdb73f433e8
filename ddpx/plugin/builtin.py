"""The built-in plugins: every run loads them, in this order, unless ``plugins.block`` names
them. They live in ``plugins/ddpx_plugins/`` and are registered by import path, not through
installed metadata, so a checkout whose metadata is stale cannot lose one silently (the way
pytest lists its ``default_plugins``). Third-party plugins join through the ``ddpx``
entry-point group, after these."""

BUILTIN_PLUGINS = {
    "sampler": "ddpx_plugins.sampler:SamplerPlugin",
    "amp": "ddpx_plugins.amp:AmpPlugin",
    "accumulation": "ddpx_plugins.accumulation:AccumulationPlugin",
    "comm_hook": "ddpx_plugins.comm_hook:CommHookPlugin",
    "logging": "ddpx_plugins.logging:LoggingPlugin",
    "checkpoint": "ddpx_plugins.checkpoint:CheckpointPlugin",
    "comm_monitor": "ddpx_plugins.comm_monitor:CommMonitorPlugin",
    "early_stopping": "ddpx_plugins.early_stopping:EarlyStoppingPlugin",
    "ema": "ddpx_plugins.ema:EmaPlugin",
    "profiler": "ddpx_plugins.profiler:ProfilerPlugin",
}
