"""What runs before and around torchrun when a user types ``ddpx train``: the launch options
(:mod:`.options`), checks of the run directory (:mod:`.preflight`), the rendezvous across
nodes (:mod:`.rendezvous`, :mod:`.slurm`), torchrun itself (:mod:`.torchrun`), the resume
record (:mod:`.resume`), and the launcher that ties them together (:mod:`.launcher`).

Nothing here runs in a rank (torchrun starts each rank as ``python -m ddpx.worker``), but the
resume command, which a rank whose launcher died says itself.
"""
