"""``ddpx train CONFIG --smoke``: the whole pipeline on a small slice of the data.

Runs across the configured processes (through the same launcher as a real
run), with every configured plugin: a few optimizer steps, one evaluation,
one checkpoint save, a resume from that checkpoint in a fresh trainer (weights
and step must come back identical) and a few more steps. Each rank records
every stage in ``<run_dir>/smoke/rank<N>.json``; the launcher prints one
PASS/FAIL/SKIP table for all ranks. An exception raised inside a plugin's hook
is reported with the plugin's name and the hook (``raised_by`` in
:mod:`ddpx.plugin.manager`, as in every run), so a broken plugin is found before
the real run. Each rank drives the trainer through its public lifecycle: ``setup``,
``train(until_step)``, ``evaluate``, ``finish``, ``close``.

Two sides: :mod:`.report` (the launcher: :func:`~.report.launch_smoke`, called by
``ddpx train --smoke``, and the table) and :mod:`.rank` (each rank, started by torchrun
as ``python -m ddpx.smoke``).
"""
