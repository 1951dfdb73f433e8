"""Checkpoint files that survive a kill at any moment.

* :func:`atomic_write` writes to a temporary file in the target directory,
  flushes and fsyncs it, ``os.replace``\\ s it over the target and fsyncs the
  directory: a reader sees either the old file or the complete new one.
* :class:`CheckpointDirectory` keeps ``step-NNNNNNNNN.pt`` files (with, for sharded
  state, a ``step-NNNNNNNNN.shards`` directory each rank wrote its part of: see
  :mod:`ddpx.strategies.shards`; it goes and is checked with its file) plus a
  ``latest`` pointer (written last, also atomically), prunes to the newest K
  (and, with a monitored metric, the best ``keep_best`` by it, listed in
  ``best.json`` and linked as ``best.pt``), and finds the newest checkpoint
  that loads, skipping a corrupt one with a warning.
* :class:`AsyncCheckpointWriter` splits a save in two: :func:`snapshot` copies
  every tensor to CPU memory on the calling (training) thread, then a
  background thread serializes and fsyncs. At most one write is in flight; the
  next save and :meth:`~AsyncCheckpointWriter.wait` wait for it.

What a checkpoint holds, and how it is read: only tensors, numbers, strings,
``None``, lists, tuples and dicts (model, optimizer and scheduler state, RNG
states, every plugin's state; :func:`check_plain` refuses anything else at
save time, naming the key). Every load goes through :func:`load_file`, which
uses ``torch.load(weights_only=True)``: a file that needs any other Python
global (a pickled object whose ``__reduce__`` could run code) is refused with
one line naming the file and that global, and nothing in it runs; a file that
``torch.save`` did not write (a YAML given by mistake, an empty or cut file) is one line
saying it is not a ddpx checkpoint. What a load allows besides plain data is listed once,
in :data:`SAFE_GLOBALS`.
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import os
import random
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

import torch

log = logging.getLogger(__name__)

FORMAT_KEY = "ddpx_checkpoint_format"
FORMAT_VERSION = 2  # plain data only, read with weights_only=True; the only format read
# What a load allows besides tensors, numbers, strings, None, lists, tuples and dicts: the one
# place. ddpx-owned types a checkpoint may hold (empty: ddpx writes plain data only).
SAFE_GLOBALS: list = []
LATEST = "latest"
BEST_INDEX = "best.json"  # the best checkpoints by the monitored metric, best first
BEST_LINK = "best.pt"  # a symlink to the best one
_NAME = re.compile(r"^step-(\d+)\.pt$")
_SHARDS = re.compile(r"^step-(\d+)\.shards$")
SHARDS_KEY = "sharded"  # in a checkpoint whose model and optimizer are in a shard directory: its name


def fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(file)`` so that it is either absent/old or complete.

    The temporary file lives in the same directory (same file system, so
    ``os.replace`` is atomic) and is removed if ``write`` raises.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def snapshot(obj: Any, buffers: Optional[dict] = None, _path: str = "") -> Any:
    """A copy of ``obj`` that later training steps cannot change: every tensor is
    copied to CPU memory, containers are rebuilt, other leaves deep-copied.

    With ``buffers`` (a dict kept between calls), the CPU tensors of the
    previous snapshot are reused when shape and dtype match: no allocation, no
    page faults, so a repeated snapshot costs less than a fresh copy. Their
    previous contents must no longer be needed. Copies from a GPU go to pinned
    memory without blocking; call :func:`torch.cuda.synchronize` before reading.
    """
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        out = buffers.get(_path) if buffers is not None else None
        if out is None or out.shape != src.shape or out.dtype != src.dtype:
            out = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
            if buffers is not None:
                buffers[_path] = out
        out.copy_(src, non_blocking=src.is_cuda)
        return out
    if isinstance(obj, dict):
        items = [(k, snapshot(v, buffers, f"{_path}/{k!r}")) for k, v in obj.items()]
        try:
            out = type(obj)(items)  # keeps OrderedDict (module state_dicts)
        except TypeError:  # e.g. defaultdict
            out = dict(items)
        if hasattr(obj, "_metadata"):  # module state_dict versions, used by load_state_dict
            out._metadata = copy.deepcopy(obj._metadata)
        return out
    if isinstance(obj, list):
        return [snapshot(v, buffers, f"{_path}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(snapshot(v, buffers, f"{_path}/{i}") for i, v in enumerate(obj))
    return copy.deepcopy(obj)


# --- RNG state of one process ------------------------------------------------------------


def rng_state(device: Optional[torch.device] = None) -> dict:
    """This process's RNG states: torch CPU, the CUDA device (if used), Python
    ``random`` and numpy's global generator (if numpy is imported)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device is not None and torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        # Plain data (weights_only loads no numpy array): the 624 uint32 words as int64.
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    return state


def set_rng_state(state: dict, device: Optional[torch.device] = None) -> None:
    """Restore what :func:`rng_state` captured (parts absent here are skipped)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        import numpy

        saved = state["numpy"]
        numpy.random.set_state((saved["kind"], saved["keys"].numpy().astype(numpy.uint32), saved["pos"],
                                saved["has_gauss"], saved["cached_gaussian"]))


# --- plain data only: what is written, and how it is read -----------------------------


_PLAIN_TYPES = (str, bytes, bool, int, float, complex, type(None))  # exact types: a subclass pickles by name
_TORCH_LEAVES = (torch.Tensor, torch.dtype, torch.device, torch.Size)


def check_plain(obj: Any, where: str = "checkpoint") -> None:
    """Raise a one-line :class:`~ddpx.errors.DdpxError` naming the key of the first
    value that ``torch.load(weights_only=True)`` could not read back."""
    kind = type(obj)
    if kind in _PLAIN_TYPES or isinstance(obj, _TORCH_LEAVES) or kind in SAFE_GLOBALS:
        return
    if kind in (dict, collections.OrderedDict):
        for key, value in obj.items():
            if type(key) not in (str, int):
                _not_plain(key, f"{where} (a key)")
            check_plain(value, f"{where}/{key}")
        return
    if kind in (list, tuple):
        for i, value in enumerate(obj):
            check_plain(value, f"{where}/{i}")
        return
    _not_plain(obj, where)


def _not_plain(obj: Any, where: str) -> None:
    from ..errors import DdpxError

    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    raise DdpxError(f"{where} is a {kind}: checkpoint state must be tensors, numbers, strings, lists and dicts "
                    "(convert it in the plugin's ddpx_state_dict)")


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in ``obj`` (nested dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _out_of_space(exc: BaseException, directory: Path, needed: int) -> bool:
    """Whether a failed write ran out of disk: an ENOSPC/EDQUOT anywhere in the exception's
    chain (torch's zip writer raises its own RuntimeError on top), or a zip-writer failure
    with less space left than the state needs."""
    import errno
    import shutil

    seen, chain = exc, []
    while seen is not None and seen not in chain:
        chain.append(seen)
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        writer_failed = any(w in str(exc) for w in ("write failed", "inline_container"))
        return writer_failed and shutil.disk_usage(directory).free < max(needed, 1 << 20)
    except OSError:
        return False


class UnsafeCheckpoint(Exception):
    """A checkpoint file that needs Python globals beyond plain data: not loaded."""


class NotACheckpoint(Exception):
    """A file that ``torch.save`` did not write (its zip archive): not loaded. ``what``: what it
    is instead (an empty file, a text file)."""

    def __init__(self, path, what: str):
        super().__init__(f"{path} is not a ddpx checkpoint ({what})")
        self.what = what


ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive; a ddpx checkpoint is always one


def check_torch_file(path: Path) -> None:
    """Raise :class:`NotACheckpoint` naming ``path`` and what it holds instead, unless it is a
    file ``torch.save`` wrote (else unpickling a YAML says "Unsupported operand 109")."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(ZIP_MAGIC):
        return
    what = "an empty file" if not head else "a text file" if _is_text(head) else "not a file torch.save wrote"
    raise NotACheckpoint(path, what)


def _is_text(head: bytes) -> bool:
    for cut in range(4):  # the bytes read may end inside a character
        try:
            head[:len(head) - cut].decode("utf-8")
            return b"\0" not in head
        except UnicodeDecodeError:
            pass
    return False


def unsafe_globals(path: Path) -> list[str]:
    """The globals ``path`` needs that a weights-only load refuses (read from the
    pickle's opcodes, nothing runs); [] if none, or if the file cannot be scanned."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # not a zip checkpoint, truncated, ...: the load says why
        return []


def load_file(path: Path, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``, with :data:`SAFE_GLOBALS` allowed.

    Raises :class:`UnsafeCheckpoint` (one line naming the file and the global it
    needs) when the file holds anything else; nothing in it runs. :class:`NotACheckpoint`
    when ``torch.save`` did not write it."""
    check_torch_file(path)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        needs = unsafe_globals(path)
        if needs or "Weights only load failed" in str(exc):
            what = ", ".join(needs) if needs else _refused_global(exc)
            raise UnsafeCheckpoint(f"refusing checkpoint {path}: it needs {what}, which a ddpx checkpoint never "
                                   "holds (loading it could run code); nothing in it was run") from None
        raise


def _refused_global(exc: Exception) -> str:
    m = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc)) or re.search(r"Unsupported operand[^\n]*", str(exc))
    return m.group(1) if m and m.groups() else (m.group(0) if m else "a Python object that is not plain data")


# --- a directory of checkpoints ----------------------------------------------------------


class CheckpointDirectory:
    """``step-NNNNNNNNN.pt`` files, a ``latest`` pointer, the newest ``keep`` kept,
    and with ``keep_best`` > 0 also the best ``keep_best`` by a score (``mode``
    ``max`` or ``min``) given to :meth:`save`."""

    def __init__(self, directory: Path, keep: int = 3, keep_best: int = 0, mode: str = "max"):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.keep_best = keep_best
        self.mode = mode

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:09d}.pt"

    def shards_for(self, step: int) -> Path:
        """The shard directory of ``step`` (sharded state: every rank writes its part there)."""
        return self.directory / f"step-{step:09d}.shards"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Every finished checkpoint file as ``(step, path)``, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

    def save(self, state: dict, step: int, score: Optional[dict] = None) -> Path:
        """Write ``state`` as the checkpoint of ``step``, then the pointer, then prune.

        ``score`` (``{"monitor": name, "value": float, "epoch": int}``) ranks the
        checkpoint among the best ``keep_best``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(step)
        state = {FORMAT_KEY: FORMAT_VERSION, **state}
        check_plain(state)
        atomic_write(path, lambda f: torch.save(state, f))
        atomic_write(self.directory / LATEST, lambda f: f.write(path.name.encode() + b"\n"))
        if score is not None and self.keep_best > 0:
            self._rank_best(path, step, score)
        self.prune()
        return path

    def best(self) -> list[dict]:
        """The best checkpoints as recorded in ``best.json`` (``file``, ``step``,
        ``monitor``, ``value``, ``epoch``), best first, only those still on disk."""
        try:
            entries = json.loads((self.directory / BEST_INDEX).read_text())
        except (OSError, ValueError):
            return []
        return [e for e in entries if isinstance(e, dict) and (self.directory / str(e.get("file"))).is_file()]

    def _rank_best(self, path: Path, step: int, score: dict) -> None:
        entry = {"file": path.name, "step": step, **score}
        entries = [e for e in self.best() if e["file"] != path.name and e.get("monitor") == score["monitor"]]
        entries.append(entry)
        # Best first; on a tie the earlier checkpoint stays ahead.
        sign = -1.0 if self.mode == "max" else 1.0
        entries.sort(key=lambda e: (sign * e["value"], e["step"]))
        entries = entries[: self.keep_best]
        atomic_write(self.directory / BEST_INDEX, lambda f: f.write(json.dumps(entries, indent=1).encode()))
        link = self.directory / BEST_LINK
        tmp = self.directory / f".{BEST_LINK}.tmp-{os.getpid()}-link"
        tmp.unlink(missing_ok=True)
        try:
            os.symlink(entries[0]["file"], tmp)  # relative: the directory may move
            os.replace(tmp, link)
        except OSError as exc:  # a file system without symlinks: best.json still names it
            tmp.unlink(missing_ok=True)
            log.warning("cannot link %s to the best checkpoint: %s", link, exc)

    def prune(self) -> None:
        """Delete all but the newest ``keep`` checkpoints (never the one ``latest``
        names, nor the best ones) and temporary files left by a writer that was killed."""
        protected = {self._pointer()} | {self.directory / e["file"] for e in self.best()}
        kept = self.checkpoints()
        for step, path in kept[: -self.keep]:
            if path not in protected:
                path.unlink(missing_ok=True)
                shutil.rmtree(self.shards_for(step), ignore_errors=True)
        # Shard directories whose file was never written (killed in between) or is gone; newer
        # ones may belong to a save in progress.
        newest = kept[-1][0] if kept else -1
        for p in self.directory.glob("step-*.shards"):
            m = _SHARDS.match(p.name)
            if m and int(m.group(1)) < newest and not self.path_for(int(m.group(1))).exists():
                shutil.rmtree(p, ignore_errors=True)
        for p in self.directory.glob(".step-*.shards.partial"):  # a sharded save killed half-way
            shutil.rmtree(p, ignore_errors=True)
        mine = f".tmp-{os.getpid()}-"
        for p in self.directory.glob(".*.tmp-*"):
            if mine not in p.name:
                p.unlink(missing_ok=True)

    def _pointer(self) -> Optional[Path]:
        try:
            name = (self.directory / LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return self.directory / name if _NAME.match(name) else None

    def load_latest(self, map_location: Any = "cpu",
                    reject: Optional[Callable[[dict], Optional[str]]] = None) -> Optional[tuple[Path, dict]]:
        """The newest complete checkpoint as ``(path, state)``, or None if none loads.

        Tries the file ``latest`` names first, then every other checkpoint,
        newest first; an unreadable one, one that is not plain data (refused
        unread, see :func:`load_file`), or one for which ``reject(state)``
        returns a reason, is skipped with a warning. Raises
        :class:`~ddpx.errors.DdpxError` when checkpoints exist but none loads:
        starting afresh would silently train from step 0 over them.
        """
        pointed = self._pointer()
        order = [p for _, p in reversed(self.checkpoints())]
        if pointed is not None and pointed in order:
            order.remove(pointed)
            order.insert(0, pointed)
        skipped = []
        for path in order:
            try:
                state = load_file(path, map_location)
            except UnsafeCheckpoint as exc:
                log.warning("%s", exc)
                skipped.append(f"{path.name}: not plain data")
                continue
            except Exception as exc:  # truncated zip, bad pickle, I/O error: try the next
                log.warning("skipping unreadable checkpoint %s: %s", path, exc)
                skipped.append(f"{path.name}: unreadable")
                continue
            if not isinstance(state, dict) or state.get(FORMAT_KEY) != FORMAT_VERSION:
                log.warning("skipping %s: not a ddpx checkpoint (format %r)", path,
                            state.get(FORMAT_KEY) if isinstance(state, dict) else type(state))
                skipped.append(f"{path.name}: not a ddpx checkpoint")
                continue
            reason = reject(state) if reject is not None else None
            shards = state.get(SHARDS_KEY)
            if reason is None and shards is not None and not (self.directory / str(shards) / ".metadata").is_file():
                reason = f"its shard directory {shards} is missing or incomplete"
            if reason:
                log.warning("skipping checkpoint %s: %s", path, reason)
                skipped.append(f"{path.name}: {reason}")
                continue
            return path, state
        if skipped:
            from ..errors import DdpxError

            raise DdpxError(f"no checkpoint in {self.directory} can be resumed ({'; '.join(skipped)}); remove them, "
                            "use another run_dir, or set checkpoint.resume=false to start afresh")
        return None


class AsyncCheckpointWriter:
    """Runs :meth:`CheckpointDirectory.save` on a background thread, one at a time.

    ``save`` blocks only for :func:`snapshot` (one local copy of the state,
    into CPU buffers reused from the previous save: the writer keeps one copy
    of the state in CPU memory) plus waiting for the previous write. An error
    in the background write is raised by the next ``save`` or ``wait``.
    """

    def __init__(self, directory: CheckpointDirectory, async_write: bool = True):
        self.directory = directory
        self.async_write = async_write
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._buffers: dict = {}
        self._bytes = 0  # tensor bytes of the state being written (for a disk-full message)
        self.last_path: Optional[Path] = None

    def save(self, state: dict, step: int, on_done: Optional[Callable[[Path], None]] = None,
             score: Optional[dict] = None) -> None:
        self.wait()
        check_plain(state)  # here, on the training thread: a one-line error naming the key
        self._bytes = tensor_bytes(state)
        if not self.async_write:
            self._write(state, step, on_done, score)
            self._raise()
            return
        copied = snapshot(state, self._buffers)  # the previous write is done with them
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies
        self._thread = threading.Thread(
            target=self._write, args=(copied, step, on_done, score), name="ddpx-checkpoint-writer"
        )
        self._thread.start()

    def _write(self, state: dict, step: int, on_done, score) -> None:
        try:
            self.last_path = self.directory.save(state, step, score)
            if on_done is not None:
                on_done(self.last_path)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _raise(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            if _out_of_space(exc, self.directory.directory, self._bytes):
                from ..errors import DdpxError

                raise DdpxError(f"checkpoint not saved: no space left on device in {self.directory.directory} "
                                f"(needs about {max(1, round(self._bytes / 2**20))} MB); the previous checkpoint "
                                "is intact: free some space and run the same command again to resume") from None
            raise RuntimeError(f"checkpoint write failed: {exc}") from exc
