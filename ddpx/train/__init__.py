"""The trainer: one rank's run (:mod:`.trainer`: the lifecycle and the step), the default
bodies of the plugin hooks (:mod:`.default_hooks`, the plugin named "trainer"), and what
they use: batches and their loss (:mod:`.batches`), the gradient norm (:mod:`.grad_norms`),
the micro-batch losses (:mod:`.losses`), SIGTERM/SIGINT/SIGHUP and the stop agreement
(:mod:`.stopping`), the non-finite guard (:mod:`.nonfinite`), ``torch.compile``
(:mod:`.compile`), SyncBatchNorm (:mod:`.sync_batchnorm`) and the metric monitor that best
checkpoints and early stopping share (:mod:`.monitor`).
"""
