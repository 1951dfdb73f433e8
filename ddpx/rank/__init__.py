"""What every rank needs beneath the trainer, none of it knowing the trainer: joining the
process group (:mod:`.process_group`), the random streams (:mod:`.seeding`), the rank's
log handler (:mod:`.logger`), the run directory's lock (:mod:`.run_lock`), checkpoint files
that survive a kill (:mod:`.checkpoint_files`), and what a rank shares with the launcher
that started it (:mod:`.launcher_contract`).
"""
