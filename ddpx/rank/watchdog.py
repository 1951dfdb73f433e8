"""Ranks that disagree, or hang, explained within seconds instead of at the timeout.

While a run trains (``trainer.check_collectives: true``, the default), every
blocking collective issued through ``torch.distributed`` on the default group
(``dist.all_reduce(t)`` in a plugin, in ddpx, in a model) leaves a fingerprint
before it runs: its sequence number, op, reduce op, shapes and dtypes, and the
calling code (read as plugin, hook and file:line only when a report needs it).
Asynchronous collectives (comm hooks inside DDP's backward, ddpx's stop vote) and
DDP's own all-reduces are issued alike on every rank by construction and are not
recorded; neither are collectives on other groups or from other threads.

A watchdog thread per rank looks once a second. When its rank has waited
``trainer.stall_s`` in one collective, or made no progress for twice that (no
step, no collective, and its training thread's stack the same at every look: busy
code such as a long evaluation moves on), every rank is asked, through the
store (it answers while the process group is stuck), for its last
fingerprints, where it is, and its threads' stacks
(``<run_dir>/stalls/rank<N>.txt``). Then rank 0:

- finds the first sequence number at which the fingerprints differ: the ranks
  paired the wrong collectives, and nothing will mend that. It prints one
  paragraph naming each rank's collective and caller, and every rank exits with
  code 2 within a second or two;
- or, when the fingerprints agree (a slow rank, a deadlock in a data loader, a
  collective one rank has not reached yet), prints where each rank is and lets
  the job run on: ``trainer.timeout_s`` still ends it if nothing moves.

At every epoch's start and end the trainer calls :meth:`CollectiveWatchdog.agree`: one
small all_reduce that compares a digest of the fingerprints so far, and counts
every rank must share (batches, skipped steps, the weights' sum), so a
disagreement that would not hang (same shapes, paired silently) is found too.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import sys
import sysconfig
import threading
import time
import traceback
import zlib
from collections import deque
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import RanksDisagree
from ..plugin.manager import plugin_code_map

# The public collectives users and plugins call as ``dist.<name>``.
COLLECTIVES = (
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
    "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)
REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}  # default op: SUM
HISTORY = 64  # fingerprints kept per rank (and compared): enough to cover ranks a few collectives apart
STACK_DEPTH = 48  # frames kept per fingerprint
POLL_S = 1.0
GATHER_S = 5.0  # how long rank 0 waits for the other ranks' answers
KEY = "ddpx/collectives"
MISMATCH_EXIT = 2  # a bug in the code that issued the collective, like bad input
SKIPPED_DIRS = tuple({os.path.dirname(torch.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep,
                      os.path.dirname(__file__) + os.sep + "watchdog.py"})


class Fingerprint:
    """One recorded collective: what every rank must agree on (``signature``) and who called it."""

    __slots__ = ("seq", "signature", "stack")

    def __init__(self, seq: int, signature: str, stack: tuple):
        self.seq, self.signature, self.stack = seq, signature, stack


def describe(name: str, args: tuple, kwargs: dict) -> str:
    """``all_reduce(float32[1], MIN)``: the op, its tensors' dtypes and shapes, its reduce op and root."""
    parts = []
    for value in (*args, *kwargs.values()):
        part = _brief(value)
        if part:
            parts.append(part)
    op = kwargs.get("op") or next((a for a in args if isinstance(a, dist.ReduceOp.RedOpType)), None)
    if op is not None:
        parts.append(getattr(op, "name", str(op)))
    elif name in REDUCING:
        parts.append("SUM")
    for key in ("src", "dst", "group_src", "group_dst"):
        if kwargs.get(key) is not None:
            parts.append(f"{key}={kwargs[key]}")
    return f"{name}({', '.join(parts)})"


def _brief(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return f"{len(value)} x {_brief(value[0])}"
    return ""


def _other_group(args: tuple, kwargs: dict) -> bool:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return group is not None and group is not dist.GroupMember.WORLD


def _is_async(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("async_op") is True or any(a is True for a in args)


class CollectiveWatchdog:
    """This rank's recorded collectives, and the watchdog thread that compares them with the other ranks'."""

    def __init__(self, rank: int, world_size: int, stall_s: float, progress: Callable[[], dict],
                 plugin_manager=None, run_dir: Optional[pathlib.Path] = None, store=None,
                 device: torch.device = torch.device("cpu")):
        self.rank, self.world_size, self.stall_s, self.device = rank, world_size, stall_s, device
        # () -> {"step", "epoch", "batch", "batches"}: where training is; it changes as training moves on
        self.progress = progress
        self.plugin_manager, self.run_dir = plugin_manager, run_dir
        self.store = store
        self.history: deque = deque(maxlen=HISTORY)
        self.seq = 0
        self.digest = 0  # CRC of every recorded signature, in order: compared at epoch ends (agree)
        self.in_flight: Optional[Fingerprint] = None
        self.in_flight_since = 0.0
        self._originals: dict = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._main_thread = threading.get_ident()  # the thread that trains: the main one, or Ray Train's
        # Reports start on a line of their own: a progress bar may be mid-line.
        self.report = lambda text: print(text, file=sys.stderr, flush=True)
        self.exit = os._exit  # the main thread may be blocked in C++: nothing else ends it

    # --- recording -----------------------------------------------------------------------------

    def install(self) -> None:
        """Record the collectives called as ``torch.distributed.<name>`` from now on."""
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None and name not in self._originals:
                self._originals[name] = original
                setattr(dist, name, self._recording(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _recording(self, name: str, original):
        @functools.wraps(original)
        def collective(*args, **kwargs):
            if _is_async(args, kwargs) or _other_group(args, kwargs) or threading.get_ident() != self._main_thread:
                return original(*args, **kwargs)  # not in the one sequence every rank's main thread follows
            self.seq += 1
            fp = Fingerprint(self.seq, describe(name, args, kwargs), _stack(sys._getframe(1)))
            self.digest = zlib.crc32(fp.signature.encode(), self.digest)
            self.history.append(fp)
            self.in_flight_since = time.monotonic()
            self.in_flight = fp
            try:
                return original(*args, **kwargs)
            finally:
                self.in_flight = None
        return collective

    # --- the watchdog ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="ddpx-collectives-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S)
            self._thread = None

    def _watch(self) -> None:
        watch = Watch()
        while not self._stop.wait(POLL_S):
            try:
                self.look(watch, time.monotonic())
            except Exception:  # the store is gone: a rank died and the launcher reports it
                return

    def look(self, watch: "Watch", now: float) -> None:
        """One look: ask the ranks when this one is stuck, answer when asked, report on rank 0."""
        # Progress: a step, a collective, or the main thread anywhere else than a look ago (a long
        # evaluation or save is busy, not stuck; a hang shows the same stack at every look).
        main = sys._current_frames().get(self._main_thread)
        progress = (tuple(self.progress().values()), self.seq, _stack(main, depth=8) if main is not None else ())
        if progress != watch.progress:
            watch.progress, watch.progress_at = progress, now
        asked = self.store.add(f"{KEY}/asked", 0)
        if asked > watch.answered:
            self._answer(watch, asked, now)
        in_flight = self.in_flight
        stuck = (in_flight is not None and now - self.in_flight_since >= self.stall_s) \
            or now - watch.progress_at >= 2 * self.stall_s
        if stuck and watch.answered_at < watch.progress_at:  # nobody (this rank included) asked in this stall
            self._answer(watch, self.store.add(f"{KEY}/asked", 1), now)
        if watch.pending is None:
            return
        asked, since = watch.pending
        if self.rank == 0:
            answers = self._answers(asked)
            if len(answers) == self.world_size or now - since >= GATHER_S:
                watch.pending = None
                self._conclude(asked, answers)
        elif self.store.check([f"{KEY}/{asked}/verdict"]):
            watch.pending = None
            if self.store.get(f"{KEY}/{asked}/verdict") == b"mismatch":
                self.store.add(f"{KEY}/{asked}/seen", 1)
                if os.environ.get("LOCAL_RANK", "0") == "0":
                    self.report(f"ddpx: error: [rank{self.rank}] stopped: the ranks issued different collectives "
                                "(rank 0's output names them)")
                time.sleep(POLL_S)  # rank 0 first: the launcher names the first rank to exit
                self.exit(MISMATCH_EXIT)
        elif now - since >= 3 * GATHER_S:
            watch.pending = None  # rank 0 never concluded (it is gone or its Python is blocked)

    def _answer(self, watch: "Watch", asked: int, now: float) -> None:
        watch.answered, watch.answered_at, watch.pending = asked, now, (asked, now)
        self.store.set(f"{KEY}/{asked}/rank{self.rank}", json.dumps(self.answer(now)))

    def answer(self, now: float) -> dict:
        """What rank 0 needs from this rank: its last fingerprints and where it is; its stacks go to a file."""
        codes = self._codes()
        in_flight = self.in_flight
        waited = now - self.in_flight_since if in_flight is not None else None
        main = sys._current_frames().get(self._main_thread)
        stacks_file = self._write_stacks()
        return {
            "rank": self.rank,
            "progress": self.progress(),
            "history": [[fp.seq, fp.signature, caller(fp.stack, codes)] for fp in list(self.history)],
            "in_flight": in_flight.seq if in_flight is not None else None,
            "waited_s": round(waited, 1) if waited is not None else None,
            "where": caller(_stack(main), codes) if main is not None else "unknown",
            "stacks": str(stacks_file) if stacks_file else None,
        }

    def _write_stacks(self) -> Optional[pathlib.Path]:
        if self.run_dir is None:
            return None
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = []
        for ident, frame in sys._current_frames().items():
            lines.append(f'Thread "{names.get(ident, ident)}":\n')
            lines.extend(traceback.format_stack(frame))
        path = self.run_dir / "stalls" / f"rank{self.rank}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(lines))
        except OSError:
            return None
        return path

    def _answers(self, asked: int) -> list[dict]:
        keys = [f"{KEY}/{asked}/rank{r}" for r in range(self.world_size)]
        return [json.loads(self.store.get(k)) for k in keys if self.store.check([k])]

    def _conclude(self, asked: int, answers: list[dict]) -> None:
        lines = first_difference(answers)
        if lines:
            self.report("\nddpx: error: " + "\n".join(lines))
            self.store.set(f"{KEY}/{asked}/verdict", "mismatch")
            # The store goes with this process: wait (briefly) until every rank has read the verdict.
            deadline = time.monotonic() + 2 * POLL_S + 1.0
            while self.store.add(f"{KEY}/{asked}/seen", 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            self.exit(MISMATCH_EXIT)
            return
        self.store.set(f"{KEY}/{asked}/verdict", "stall")
        self.report("\n".join(where_ranks_are(answers, self.world_size, self.stall_s)))


    def agree(self, counters: dict, hints: Optional[Callable[[], dict]] = None, sums: Optional[dict] = None) -> None:
        """At a boundary every rank reaches together (an epoch's start or end): compare the collectives
        issued so far, ``counters`` (ints that must be equal on every rank) and ``sums`` (0-dim float
        tensors that must be equal up to rounding, e.g. of the weights) in one small all_reduce; raise
        :class:`RanksDisagree` on every rank, naming the first difference (and ``hints()[name]``, what to
        do about it: made only then), when they differ."""
        sums = sums or {}
        exact = torch.tensor([float(self.digest), *map(float, counters.values())], dtype=torch.float64,
                             device=self.device)
        values = torch.cat([exact, *(v.detach().to(self.device, torch.float64).reshape(1) for v in sums.values())])
        both = torch.cat([values, -values])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # max and -min of each value
        highest, lowest = both[:len(values)].tolist(), [-v for v in both[len(values):].tolist()]
        names = [None, *counters, *sums]  # None: the digest
        differs = [h != lo if i < len(exact) else abs(h - lo) > 1e-7 * max(abs(h), abs(lo), 1.0)
                   for i, (h, lo) in enumerate(zip(highest, lowest))]
        if not any(differs):
            return
        mine = {"rank": self.rank, "values": {**counters, **{k: v.item() for k, v in sums.items()}},
                "history": [[fp.seq, fp.signature, caller(fp.stack, self._codes())] for fp in self.history]}
        answers: list = [None] * self.world_size
        dist.all_gather_object(answers, mine)
        lines = first_difference(answers)
        if not lines:
            name = next(names[i] for i, d in enumerate(differs) if d and names[i] is not None)
            by_rank = ", ".join(f"rank {a['rank']}: {a['values'][name]:.10g}" for a in answers[:8])
            hint = (hints() if hints is not None else {}).get(name, "")
            lines = [f"the ranks disagree on the {name} ({by_rank}){hint}"]
        raise RanksDisagree("\n".join(lines))

    def _codes(self):
        return plugin_code_map(self.plugin_manager) if self.plugin_manager is not None else None


class Watch:
    """The watchdog thread's memory between looks."""

    def __init__(self):
        self.progress = None
        self.progress_at = time.monotonic()
        self.answered = 0  # the last request this rank answered
        self.answered_at = float("-inf")  # when
        self.pending: Optional[tuple] = None  # (request, when answered) not concluded yet


def _stack(frame, depth: int = STACK_DEPTH) -> tuple:
    """``((code, line), ...)`` innermost first: code objects stay alive anyway, frames (and their tensors) do not."""
    stack = []
    while frame is not None and len(stack) < depth:
        stack.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return tuple(stack)


def caller(stack: tuple, codes: tuple) -> str:
    """``from plugin 'myplug' in ddpx_epoch_end (myplug.py:10)``: the innermost hook implementation
    on the stack (else the innermost other function of a plugin), and the innermost line that is
    neither torch's nor Python's. ``codes``: :func:`ddpx.plugin.manager.plugin_code_map`'s."""
    hooks, functions = codes or ({}, {})
    ours = [(code, lineno) for code, lineno in stack if not code.co_filename.startswith(SKIPPED_DIRS)]
    owner = next((hooks[code] for code, _ in stack if code in hooks), None) \
        or next((functions[code] for code, _ in stack if code in functions), None)
    if owner is not None:
        text = f"from plugin '{owner[0]}' in {owner[1]}"
    elif ours:
        text = f"in {ours[0][0].co_qualname}"
    else:
        text = "outside any plugin"
    if ours:
        text += f" ({os.path.basename(ours[0][0].co_filename)}:{ours[0][1]})"
    return text


def first_difference(answers: list[dict]) -> list[str]:
    """The paragraph naming the first collective whose fingerprints differ between ranks, or []."""
    by_rank = {a["rank"]: {seq: (signature, who) for seq, signature, who in a["history"]} for a in answers}
    common = set.intersection(*(set(h) for h in by_rank.values())) if by_rank else set()
    for seq in sorted(common):
        groups: dict = {}
        for rank in sorted(by_rank):
            groups.setdefault(by_rank[rank][seq][0], []).append(rank)
        if len(groups) > 1:
            lines = [f"the ranks issued different collectives: collective {seq} differs"]
            for signature, ranks in groups.items():
                who = by_rank[ranks[0]][seq][1]
                lines.append(f"  {_ranks(ranks)}: {signature} {who}")
            lines.append("  every rank must issue the same collectives in the same order (a collective under "
                         "`if trainer.is_main:` runs on rank 0 only); see docs/troubleshooting.md")
            return lines
    return []


def where_ranks_are(answers: list[dict], world_size: int, stall_s: float, shown: int = 8) -> list[str]:
    """One line per rank (the first ``shown``): the collective it waits in, or the code it is in."""
    lines = [f"\nddpx: warning: a rank made no progress for {stall_s:g} s or more; where each rank is "
             "(the job goes on, and trainer.timeout_s ends it if nothing moves):"]
    answered = {a["rank"]: a for a in answers}
    for rank in range(min(world_size, shown)):
        a = answered.get(rank)
        if a is None:
            lines.append(f"  rank {rank}: did not answer (its Python is blocked, or it is gone)")
            continue
        history = {seq: (signature, who) for seq, signature, who in a["history"]}
        place = a["progress"].get("place")
        name = f"rank {rank} ({place})" if place else f"rank {rank}"
        if a["in_flight"] is not None and a["in_flight"] in history:
            signature, who = history[a["in_flight"]]
            lines.append(f"  {name}: waits {a['waited_s']:g} s in collective {a['in_flight']}, "
                         f"{signature} {who}")
        else:
            done = max(history) if history else 0
            lines.append(f"  {name}: {a['where']}, at step {a['progress']['step']}, after collective {done}")
    if world_size > shown:
        lines.append(f"  ... and {world_size - shown} more ranks")
    stacks = next((a["stacks"] for a in answers if a.get("stacks")), None)
    if stacks:
        lines.append(f"  every thread's stack: {os.path.dirname(stacks)}/rank<N>.txt")
    return lines


def _ranks(ranks: list[int]) -> str:
    """``rank 1``, ``ranks 0, 2-7``."""
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, [*ranks[1:], None]):
        if cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(spans)}"
