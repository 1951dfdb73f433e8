"""Rank 0's progress: on a terminal a tqdm bar, one for the whole run, labelled with the epoch,
showing the mean loss since its previous redraw and the throughput of the latest step line;
elsewhere (a pipe, ``| tee``, a file, a job's log) a plain line about every ``LINE_SECONDS``
instead of redraws that pile up in the file.

While the bar is drawn, whole lines that anything else in the process writes to stderr (a
library's warning, a print) are written above it (the bar cleared first, then redrawn), and
the other ranks sharing the terminal clear the line before theirs (ddpx's console streams,
:class:`ddpx.console.SurvivingStream`)."""

import sys
import time

from ddpx.console import SurvivingStream

BAR_SECONDS = 0.1  # the bar advances about this often (tqdm redraws at most every 0.1 s anyway)
MAX_BAR_STEPS = 1000  # and at least every this many optimizer steps
LINE_SECONDS = 30.0  # a plain progress line about this often
CLEAR_LINE = "\r\033[K"  # the cursor to the start of the line, the line erased


def on_terminal(stream=None) -> bool:
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class PlainProgress:
    """The part of tqdm's interface the bar uses, for a console that is not a terminal: a line
    (through ``write``) at the first update after ``LINE_SECONDS``."""

    def __init__(self, total, desc, samples_per_batch, write):
        self.total, self.n, self.desc = total, 0, desc
        self.samples_per_batch, self.write = samples_per_batch, write
        self.postfix = {}
        self.shown = (time.perf_counter(), 0)  # (time, n) of the last line

    def due(self):
        return time.perf_counter() - self.shown[0] >= LINE_SECONDS

    def update(self, n):
        self.n += n
        if self.due():
            now, (then, done) = time.perf_counter(), self.shown
            self.shown = (now, self.n)
            of = f"/{self.total} batches ({100 * self.n / self.total:.0f}%)" if self.total else " batches"
            loss = f", loss {self.postfix['loss']}" if "loss" in self.postfix else ""
            rate = (self.n - done) * self.samples_per_batch / max(now - then, 1e-9)
            self.write(f"{self.desc}: {self.n}{of}{loss}, {rate:.0f} samples/s")

    def set_postfix(self, postfix, refresh=False):
        self.postfix = dict(postfix)

    def set_description(self, desc, refresh=False):
        self.desc = desc

    def close(self):
        pass


class ProgressBar:
    """The progress part of :class:`~ddpx_plugins.logging.metrics_log.MetricsLog` (its base
    class). It counts the micro-batches of the log's ``window`` (the trainer's loss window
    since the last step line) and shows the mean of its own ``bar_window``."""

    def __init__(self):
        self.bar = None  # a tqdm on a terminal, else a PlainProgress
        self.bar_window = None  # the trainer's LossWindow since the bar's last redraw (rank 0)
        self.postfix = {}  # the bar's loss and samples/s
        self.bar_shown = 0  # micro-batches of the window already shown on the bar
        self.bar_steps = 1  # optimizer steps between bar updates, adapted to the step time
        self.around_bar = None  # the stderr stream whose lines go above the bar (or clear it), while it runs

    def start_bar(self, epoch, batches_left, write):
        """One bar for the whole run, as the Hugging Face Trainer shows (a tqdm per
        epoch costs about 100 us to build and draw, which short epochs feel). Its
        total is re-estimated at each epoch start: the batches done plus this
        epoch's batches times the epochs left. ``write``: where plain lines go."""
        if self.bar is None:
            if on_terminal():
                from tqdm import tqdm

                stream = sys.stderr
                raw = stream.raw if isinstance(stream, SurvivingStream) else stream
                self.bar = tqdm(total=batches_left, desc=f"epoch {epoch}", unit="batch", file=raw, dynamic_ncols=True)
                if isinstance(stream, SurvivingStream):  # other writers' lines go above the bar
                    stream.line_writer = lambda text: tqdm.write(text, file=raw, end="")
                    self.around_bar = stream
            else:
                self.bar = PlainProgress(batches_left, f"epoch {epoch}", self.samples_per_batch, write)
        else:
            self.bar.total = None if batches_left is None else self.bar.n + batches_left
            self.bar.set_description(f"epoch {epoch}", refresh=False)

    def advance_bar(self):
        if self.bar is None or self.window is None:
            return
        if not isinstance(self.bar, PlainProgress) or self.bar.due():
            loss_sum, count = self.bar_window.take()
            if count:  # one host read per redraw (per plain line), none per step
                self.postfix["loss"] = f"{loss_sum.item() / count:.4f}"
                self.bar.set_postfix(self.postfix, refresh=False)
        pending = self.window.pending
        if pending > self.bar_shown:
            self.bar.update(pending - self.bar_shown)
        self.bar_shown = pending

    def close_bar(self):
        if self.bar is not None:
            self.advance_bar()
            self.bar.close()
            self.bar = None
        if self.around_bar is not None:
            self.around_bar.line_writer = None
            self.around_bar = None


def clear_line_before_mine(rank, progress):
    """A rank without the bar that shares rank 0's terminal: each of its lines first erases the
    line the bar is drawn on (the bar comes back at its next redraw), instead of ending up after
    it. Returns the stream to restore (``line_writer = None``) at the end, or None."""
    stream = sys.stderr
    if rank == 0 or not progress or not isinstance(stream, SurvivingStream) or not on_terminal(stream):
        return None
    raw = stream.raw
    stream.line_writer = lambda text: raw.write(CLEAR_LINE + text)
    return stream
