"""A ddpx process's console (stdout, stderr) when its reader goes away, and the run
directory's copy of what the console said (``console.log``).

``ddpx train ... 2>&1 | tee train.log`` and Ctrl-C: the terminal sends SIGINT to its whole
foreground process group, so ``tee`` dies with the launcher's SIGINT, and every later write
of the launcher and its workers into the pipe fails with EPIPE. Python ignores SIGPIPE, so
that write raises BrokenPipeError wherever it happens (a print, the progress bar, the stop
signal's own message) and the run ends there, without its final checkpoint.
:func:`survive_closed_console` makes the stream that loses its reader harmless instead: the
first write that fails points its descriptor at /dev/null, so every later write, from Python
or C++, succeeds and goes nowhere, and the stop goes on as in a terminal. What a user needs
afterwards is in ``<run_dir>/console.log`` too: the ``ddpx`` log lines of the ranks and the
launcher's last lines (the stop and the command that resumes).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path
from typing import Iterator, Optional

CONSOLE_LOG = "console.log"  # in the run directory
GONE = (errno.EPIPE, errno.EIO)  # a pipe without a reader; a terminal that hung up
_silenced: set = set()  # descriptors pointed at /dev/null after their reader went away


def console_gone(fd: int = 2) -> bool:
    """Whether descriptor ``fd`` lost its reader or terminal (and now writes to /dev/null)."""
    return fd in _silenced


def silence(fd: int) -> None:
    """Point descriptor ``fd`` at /dev/null: later writes succeed and go nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    _silenced.add(fd)


def write_fd(fd: int, data: bytes) -> None:
    """``os.write`` for signal handlers (no Python stream, whose lock the signal may hold),
    harmless once the reader is gone."""
    try:
        os.write(fd, data)
    except OSError as exc:
        if exc.errno not in GONE:
            raise
        silence(fd)


class SurvivingStream:
    """A text stream (``sys.stdout``, ``sys.stderr``) whose EPIPE or EIO silences its
    descriptor instead of raising. ``copy`` (a path, or None) also receives what is written;
    ``line_writer`` (a callable, or None), while set, writes each whole line instead (a
    progress bar's: the line above the bar), the rest of a line waiting for its end."""

    def __init__(self, stream):
        self.raw = stream
        self._fd = stream.fileno()
        self.copy: Optional[Path] = None
        self._copy_file = None
        self._line_writer = None
        self._partial = ""

    @property
    def line_writer(self):
        return self._line_writer

    @line_writer.setter
    def line_writer(self, writer):
        partial, self._partial = self._partial, ""
        self._line_writer = writer
        if partial:
            self._guarded(self.raw.write, partial)

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except OSError as exc:
            if exc.errno not in GONE:
                raise
            silence(self._fd)
            with contextlib.suppress(OSError):
                return call(*args)  # what was buffered now goes to /dev/null
        return None

    def write(self, text):
        if self.copy is not None:
            self._write_copy(text)
        if self._line_writer is not None:
            lines, newline, self._partial = (self._partial + text).rpartition("\n")
            if newline:
                self._guarded(self._line_writer, lines + newline)
            return len(text)
        written = self._guarded(self.raw.write, text)
        return len(text) if written is None else written

    def flush(self):
        self._guarded(self.raw.flush)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def _write_copy(self, text):
        try:
            if self._copy_file is None:
                self._copy_file = open(self.copy, "a", encoding="utf-8")
            self._copy_file.write(text)
            self._copy_file.flush()
        except OSError:
            self.copy = None  # the run directory went away: the console still gets it

    def stop_copying(self):
        self.copy = None
        if self._copy_file is not None:
            with contextlib.suppress(OSError):
                self._copy_file.close()
            self._copy_file = None

    def __getattr__(self, name):
        return getattr(self.raw, name)


def survive_closed_console() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in :class:`SurvivingStream` (once; a stream
    without a descriptor, such as a test's capture, is left as it is)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, SurvivingStream):
            continue
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        setattr(sys, name, SurvivingStream(stream))


@contextlib.contextmanager
def copied_to(path) -> Iterator[None]:
    """Inside: what this process writes to ``sys.stderr`` is appended to ``path`` too
    (opened at the first write). Needs :func:`survive_closed_console` first."""
    stream = sys.stderr if isinstance(sys.stderr, SurvivingStream) else None
    if stream is not None:
        stream.copy = Path(path)
    try:
        yield
    finally:
        if stream is not None:
            stream.stop_copying()


def append_line(path, line: str) -> None:
    """Append one line to ``path`` (a run's console.log), if it can be written."""
    with contextlib.suppress(OSError):
        with open(path, "a", encoding="utf-8") as f:
            f.write(line.rstrip("\n") + "\n")
