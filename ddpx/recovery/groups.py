"""One replica group's side of a live run: torchft's ``Manager`` around the trainer's steps.

Every step starts with a quorum (:meth:`ReplicaGroups.begin_step`): the Lighthouse says which
groups train this step. A group that is behind (one that just started, or missed a commit) heals
first: it receives everything a checkpoint holds (:meth:`~ddpx.train.trainer.Trainer.state_dict`:
model, optimizer, scheduler, progress, sampler position, comm-hook memory, EMA, plugin state) from
a group that is up to date, over HTTP, rank by rank. After the backward passes,
:meth:`ReplicaGroups.commit_step` averages the gradients across the groups
(:mod:`ddpx.recovery.codecs`) and asks the manager whether the step counts: only when every
collective of it succeeded, in every group of the quorum. A step that does not count is dropped
(the trainer then neither steps the optimizer nor counts it, so no plugin acts on it), and the
next quorum goes on without the group that failed.

The quorum is taken synchronously, before the step's batches are drawn, because which samples a
rank trains depends on the groups that train (:mod:`ddpx.recovery.sampler`). It costs one round trip
to this group's manager server, 1-3 ms on loopback.
"""

from __future__ import annotations

import hashlib
import http.server
import logging
import os
import socket
import time
import warnings
from datetime import timedelta
from typing import Optional

import torch

from ..errors import DdpxError
from ..rank import process_group
from .codecs import Across, Codec
from .sampler import LiveBatchSampler
from .torchft_import import require_torchft

GO_ON, RESTART, MOVED = "go on", "restart the batches", "epoch moved"  # what begin_step says
STORE_PORT_KEY = "ddpx/live/manager_store_port"
GROUP_ENV = "DDPX_REPLICA_GROUP"  # the launcher names each group (its address and store port)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class ReplicaGroups:
    """This rank's manager, its process group across the replica groups and the step protocol."""

    def __init__(self, trainer, codec: Codec):
        os.environ.setdefault("RUST_LOG", "error")  # before torchft's Rust logger starts: see _quiet_torchft
        require_torchft("elastic.recovery=live")
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        cfg = trainer.config.elastic
        self.trainer, self.codec = trainer, codec
        self.name = os.environ.get(GROUP_ENV) or f"{socket.gethostname()}:{os.getpid()}"
        lighthouse = os.environ.get(LIGHTHOUSE_ENV) or (f"http://{cfg.lighthouse}" if cfg.lighthouse else None)
        self.lighthouse = lighthouse
        if not lighthouse:
            raise DdpxError("elastic.recovery=live needs the Lighthouse's address: start `ddpx lighthouse` on one "
                            "host and give every node `--lighthouse HOST:PORT` (or elastic.lighthouse)")
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # the launcher's: this node's address toward the Lighthouse
        _quiet_torchft()
        _advertise(host)
        self.timeout = timedelta(seconds=cfg.timeout_s)
        pg = ProcessGroupNCCL(timeout=self.timeout) if trainer.device.type == "cuda" else \
            ProcessGroupGloo(timeout=self.timeout)
        self._healed = False
        self.manager = Manager(
            pg=pg, load_state_dict=self._heal, state_dict=self._state, min_replica_size=cfg.min_groups,
            use_async_quorum=False, timeout=self.timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=self.timeout, rank=trainer.rank, world_size=trainer.world_size, store_addr=host,
            store_port=_manager_store(host, trainer.rank), lighthouse_addr=lighthouse, replica_id=self.name,
            hostname=host, init_sync=False, quorum_retries=int(cfg.lighthouse_retries))
        self.manager._client = _QuorumIdentity(self.manager)
        self.across = Across(self.manager, self.timeout)
        self.groups: Optional[int] = None  # in the last quorum
        self.fresh = True  # no step was drawn since the layout was set: the loader need not restart
        self._dropped_since = 0  # steps the groups did not commit since the last membership line
        self._last_commit = time.monotonic()
        self._quorum_id = None
        self.slot = trainer.rank  # this rank's place among all ranks of the quorum's groups
        self._quorum_kept = False  # the quorum of the coming step was taken already (see begin_step)

    # --- the trainer's state, for a group that heals ------------------------------------------

    def _state(self) -> dict:
        return self.trainer.state_dict()

    def _heal(self, state: dict) -> None:
        self.trainer.load_state_dict(state)
        self._healed = True

    # --- the step ------------------------------------------------------------------------------

    def begin_step(self, sampler: Optional[LiveBatchSampler]) -> str:
        """The quorum of the coming step; lays out the epoch over the groups in it. Returns
        :data:`RESTART` when the trainer's batch iterator must start again (another layout, a
        dropped step or a heal), :data:`MOVED` after a heal into another epoch (the trainer starts
        that epoch and calls again, which keeps the quorum taken: the others train this step
        already), else :data:`GO_ON`."""
        trainer = self.trainer
        if self._quorum_kept:  # taken, and healed in, before the heal moved the epoch
            self._quorum_kept, healed = False, True
        else:
            epoch_before = trainer.epoch
            healed = self._take_quorum(sampler)
            if healed and trainer.epoch != epoch_before:
                self._quorum_kept = True
                return MOVED
        restart = healed or not self.fresh
        self.slot = (self.manager.participating_rank() or 0) * trainer.world_size + trainer.rank
        if sampler is not None:
            restart |= sampler.place(self.slot, max(self.groups, 1) * trainer.world_size)
        self.fresh = not restart
        return RESTART if restart else GO_ON

    def _take_quorum(self, sampler: Optional[LiveBatchSampler]) -> bool:
        """Ask for this step's quorum (blocks; a group behind heals in it); whether it healed."""
        trainer = self.trainer
        self._healed = False
        self.manager.start_quorum()  # a failed heal or reconfigure: the step will not commit, the next retries
        groups = self.manager.num_participants()
        if groups != self.groups:
            self._membership_line(self.groups, groups)
            self.groups = groups
        if self._healed:
            trainer.log.info(f"replica group {self.name}: healed from a peer at step {trainer.global_step} "
                             f"(epoch {trainer.epoch})")
        if self.manager._quorum_id != self._quorum_id:  # another membership: do the groups hold one state?
            self._quorum_id = self.manager._quorum_id
            if groups > 1:
                self._check_same_state(sampler)
        return self._healed

    def _check_same_state(self, sampler: Optional[LiveBatchSampler]) -> None:
        """Two quorums can form apart and reach the same step with different states (groups that
        start a moment apart, a Lighthouse that restarts): torchft heals only a group whose step
        is behind. So at each new quorum the groups compare the step, the epoch, the sampler's
        position and the weights' sum; a group that differs from the quorum's first group moves
        its step back and does not commit this one, so the next quorum heals it from a peer."""
        trainer = self.trainer
        with torch.no_grad():
            weights = sum(p.detach().double().sum() for p in trainer.module.parameters()).cpu()
        mine = torch.tensor([trainer.global_step, trainer.epoch, sampler.consumed if sampler else 0, 0.0],
                            dtype=torch.float64)
        mine[3] = weights
        gathered = torch.empty(self.groups * 4, dtype=torch.float64)
        if not self.across.all_gather(gathered, mine):
            return  # a group failed: this step will not commit anyway
        first = gathered.view(self.groups, 4)[0]
        if torch.equal(first, mine):
            return
        trainer.log.warning(f"replica group {self.name}: its state differs from the quorum's first group's at "
                            f"step {trainer.global_step} (two quorums formed apart): healing from a peer")
        self.manager._step = max(0, self.manager._step - 1)  # behind: the next quorum heals this group
        self.manager.report_error(RuntimeError("replica groups diverged"))

    def commit_step(self) -> bool:
        """Average the gradients across the groups, then whether every group may step."""
        from .. import ops

        grads = _grads([p for p in self.trainer.module.parameters() if p.requires_grad])
        flat = ops.flatten(grads)
        if self.codec.exchange(flat, self.across):
            ops.unflatten_(flat, grads)
        committed = self.manager.should_commit()
        self.fresh = committed
        if committed:
            self._last_commit = time.monotonic()
        else:
            self._dropped_since += 1
        return committed

    def _membership_line(self, before: Optional[int], now: int) -> None:
        trainer = self.trainer
        if not trainer.is_main:
            return
        if before is None:
            trainer.log.info(f"replica group {self.name}: training with {now} replica group(s) (Lighthouse "
                             f"{self.lighthouse.removeprefix('http://')}) from step {trainer.global_step}")
        else:
            dropped, self._dropped_since = self._dropped_since, 0
            trainer.log.warning(f"replica group {self.name}: {before} -> {now} replica groups at step "
                                f"{trainer.global_step} ({time.monotonic() - self._last_commit:.1f} s since the last "
                                f"committed step; {dropped} step(s) dropped)")


class _QuorumIdentity:
    """The manager's client, with each quorum told apart from the ones before a Lighthouse restart.

    A Lighthouse that restarts numbers its quorums from 1 again. torchft names a quorum's process
    group by that number (the rendezvous keys in the first group's store), and reconfigures only
    when the number changed: after a restart, a quorum of other groups could reuse a number and
    meet stale keys, or not be reconfigured at all. So the number the manager sees changes when
    the Lighthouse's number or the groups change, and is made of those and the step the quorum
    formed at (the same for every group in it), which no earlier quorum of the run shares."""

    def __init__(self, manager):
        self._client = manager._client
        self._last, self._id = None, None  # the Lighthouse's (number, groups), and the number given for it

    def _quorum(self, **kwargs):
        result = self._client._quorum(**kwargs)
        key = (result.quorum_id, tuple(result.replica_ids))
        if key != self._last:
            digest = hashlib.sha256(repr((*key, result.max_step)).encode()).digest()  # the same in every process
            self._last, self._id = key, int.from_bytes(digest[:8], "big") & (2 ** 62 - 1)
        return _Quorum(result, self._id)

    def __getattr__(self, name):
        return getattr(self._client, name)


class _Quorum:
    """A quorum result with another ``quorum_id`` (see :class:`_QuorumIdentity`)."""

    def __init__(self, result, quorum_id: int):
        self._result, self.quorum_id = result, quorum_id

    def __getattr__(self, name):
        return getattr(self._result, name)


def _grads(params) -> list:
    """The gradients to average, in parameter order (the same in every group): a parameter this
    step did not reach gets a zero gradient, so every group sends the same layout."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


def _manager_store(host: str, rank: int) -> int:
    """The port of a store for the manager's keys, served by this group's rank 0 for this attempt
    (torchrun's store keeps a previous attempt's manager address after a restart)."""
    from torch.distributed import TCPStore

    store = process_group.run_store()
    if rank == 0:
        served = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        _KEEP.append(served)
        store.set(STORE_PORT_KEY, str(served.port))
        return served.port
    return int(store.get(STORE_PORT_KEY).decode())


_KEEP: list = []  # the served store lives as long as the process


def _advertise(host: str) -> None:
    """torchft tells its peers where to reach this process by ``socket.gethostname()`` (its
    process group's store, its checkpoint server). Where the hostname does not resolve to an
    address the other hosts reach (Debian's 127.0.1.1 line, containers, network namespaces) that
    fails, so this process answers with the address the launcher chose."""
    socket.gethostname = lambda: host


def _quiet_torchft() -> None:
    """torchft logs several lines per step (its Rust manager at INFO, every checkpoint request);
    ddpx prints one line per membership change instead (RUST_LOG=info shows them again)."""
    # a heal's tensors arrive in a read-only buffer; they are copied into the model at once
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.ERROR)
    http.server.BaseHTTPRequestHandler.log_message = lambda *args, **kwargs: None
