"""The trainer: one rank's run (:mod:`.trainer`: the lifecycle and the step), the default
bodies of the plugin hooks (:mod:`.default_hooks`), and what they use: the stop agreement
(:mod:`.stopping`), the micro-batch losses (:mod:`.losses`), ``torch.compile``
(:mod:`.compile`), SyncBatchNorm (:mod:`.sync_batchnorm`) and the metric monitor that
best checkpoints and early stopping share (:mod:`.monitor`).
"""
