"""Rank 0's tqdm progress bar: one bar for the whole run, labelled with the epoch, showing
the mean loss since its previous redraw and the throughput of the latest step line."""

import sys

BAR_SECONDS = 0.1  # the bar advances about this often (tqdm redraws at most every 0.1 s anyway)
MAX_BAR_STEPS = 1000  # and at least every this many optimizer steps


class ProgressBar:
    """The bar's part of :class:`~ddpx_plugins.logging.metrics_log.MetricsLog` (its base
    class). It counts the micro-batches of the log's ``window`` (the trainer's loss window
    since the last step line) and shows the mean of its own ``bar_window``."""

    def __init__(self):
        self.bar = None
        self.bar_window = None  # the trainer's LossWindow since the bar's last redraw (rank 0)
        self.postfix = {}  # the bar's loss and samples/s
        self.bar_shown = 0  # micro-batches of the window already shown on the bar
        self.bar_steps = 1  # optimizer steps between bar updates, adapted to the step time

    def start_bar(self, epoch, batches_left):
        """One bar for the whole run, as the Hugging Face Trainer shows (a tqdm per
        epoch costs about 100 us to build and draw, which short epochs feel). Its
        total is re-estimated at each epoch start: the batches done plus this
        epoch's batches times the epochs left."""
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=batches_left, desc=f"epoch {epoch}", unit="batch", file=sys.stderr,
                            dynamic_ncols=True)
        else:
            self.bar.total = None if batches_left is None else self.bar.n + batches_left
            self.bar.set_description(f"epoch {epoch}", refresh=False)

    def advance_bar(self):
        if self.bar is not None and self.window is not None:
            loss_sum, count = self.bar_window.take()
            if count:  # one host read per redraw, none per step
                self.postfix["loss"] = f"{loss_sum.item() / count:.4f}"
                self.bar.set_postfix(self.postfix, refresh=False)
            pending = self.window.pending
            if pending > self.bar_shown:
                self.bar.update(pending - self.bar_shown)
            self.bar_shown = pending
