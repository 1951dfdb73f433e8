"""The console of a run: a stream whose reader went away (``| tee`` and Ctrl-C) does not end the
run; the progress as plain lines where the console is not a terminal; the epoch line's
communication; the run directory's console.log."""

import io
import os
import re
from types import SimpleNamespace

import pytest
import torch

from ddpx import console
from ddpx.console import SurvivingStream, console_gone, write_fd
from ddpx.plugin.shared import COMM_HOOK


@pytest.fixture
def closed_pipe():
    """A text stream on a pipe whose reader is gone (tee killed by Ctrl-C)."""
    read, write = os.pipe()
    os.close(read)
    stream = io.TextIOWrapper(os.fdopen(write, "wb"), line_buffering=True)
    yield stream, write
    console._silenced.discard(write)
    stream.close()


def test_a_stream_whose_reader_is_gone_goes_to_dev_null_instead_of_raising(closed_pipe, tmp_path):
    raw, fd = closed_pipe
    with pytest.raises(BrokenPipeError):
        raw.write("what the launcher printed\n")  # what ended the stop before
    stream = SurvivingStream(raw)
    stream.copy = tmp_path / "console.log"
    print("ddpx: stopped by SIGINT", file=stream, flush=True)
    assert console_gone(fd)
    print("ddpx: to resume this run: ...", file=stream, flush=True)  # later writes succeed, to /dev/null
    os.write(fd, b"C++ writes too\n")
    stream.stop_copying()
    assert (tmp_path / "console.log").read_text() == "ddpx: stopped by SIGINT\nddpx: to resume this run: ...\n"


def test_a_signal_handlers_write_survives_a_closed_pipe(closed_pipe):
    _, fd = closed_pipe
    write_fd(fd, b"[rank0] ddpx: received SIGINT: stopping ...\n")  # raised BrokenPipeError in the handler
    assert console_gone(fd)
    write_fd(fd, b"again\n")


def test_whole_lines_go_through_the_line_writer_the_rest_waits():
    raw = io.StringIO()
    raw.fileno = lambda: 2  # a console stream
    stream = SurvivingStream(raw)
    lines = []
    stream.line_writer = lines.append
    stream.write("/path/lib.py:9: UserWarning: a library's warning")  # warnings and print write in pieces
    stream.write("\n  warnings.warn(...)\nsomelib says hi\nhalf a li")
    assert lines == ["/path/lib.py:9: UserWarning: a library's warning\n  warnings.warn(...)\nsomelib says hi\n"]
    stream.line_writer = None  # the bar closed: what waited is written
    stream.write("ne\n")
    assert raw.getvalue() == "half a line\n"


def test_off_a_terminal_the_progress_is_a_plain_line_now_and_then(monkeypatch):
    """No tqdm redraws piling up in ``| tee train.log``: a line about every LINE_SECONDS."""
    from ddpx.train.losses import EpochLosses
    from ddpx_plugins.logging import progress
    from ddpx_plugins.logging.metrics_log import MetricsLog

    monkeypatch.setattr(progress, "on_terminal", lambda stream=None: False)
    losses, lines = EpochLosses(), []
    log = MetricsLog(every_steps=50, progress=True, samples_per_batch=32)
    log.window, log.bar_window = losses.open_window(), losses.open_window()
    log.start_bar(3, 10, lines.append)
    assert isinstance(log.bar, progress.PlainProgress)
    losses.append(torch.tensor(2.0))
    log.advance_bar()
    assert lines == []  # not yet due
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    losses.append(torch.tensor(4.0))
    log.advance_bar()
    (line,) = lines
    assert re.fullmatch(r"epoch 3: 2/10 batches \(20%\), loss 3\.0000, \d+ samples/s", line), line
    log.close()


class CountingHook:
    """A comm hook's totals: 11048 bytes sent per step against fp32's 19240 (fp16, two ranks)."""

    def __init__(self):
        self.steps = 0

    def stats(self):
        return {"wire_bytes": 11048 * self.steps, "fp32_wire_bytes": 19240 * self.steps, "steps": self.steps}


def test_the_epoch_line_says_what_the_comm_hook_saved_that_epoch():
    from ddpx_plugins.logging.metrics_log import MetricsLog

    hook = CountingHook()
    hook.steps = 100  # restored from a checkpoint: not this run's traffic
    trainer = SimpleNamespace(shared={COMM_HOOK: hook})
    log = MetricsLog(every_steps=50, progress=False, samples_per_batch=32)
    log.count_comm_from_here(trainer)
    hook.steps += 23
    assert log.comm_this_epoch(trainer) == "; comm 11 kB/step, 1.74x less than fp32 allreduce (19.2 kB)"
    assert log.comm_this_epoch(trainer) == ""  # no step since
    assert log.comm_this_epoch(SimpleNamespace(shared={})) == ""  # DDP's own allreduce: nothing to say


def test_an_epoch_ends_in_one_line_and_console_log_holds_what_the_console_showed(make_config, tmp_path, capfd):
    """A 'saved checkpoint' line every epoch is gone: the run's last checkpoint is said (also when
    it was an epoch end's), every save at logging.level=debug; console.log has the same lines."""
    from ddpx.train.trainer import Trainer

    def ddpx_lines(text):
        return [line for line in text.splitlines() if line.startswith("[rank0] ")]

    Trainer(make_config("trainer.eval_every_epochs=0", "trainer.epochs=2", run_dir=tmp_path / "run")).run()
    shown = ddpx_lines(capfd.readouterr().err)
    saves = [line for line in shown if "saved checkpoint" in line]
    assert saves == [f"[rank0] saved checkpoint {tmp_path / 'run' / 'checkpoints' / 'step-000000090.pt'} "
                     "(end of epoch 1, step 90)"], shown
    assert shown[-1].startswith("[rank0] finished after ")
    assert ddpx_lines((tmp_path / "run" / "console.log").read_text()) == shown

    Trainer(make_config("trainer.eval_every_epochs=0", "trainer.epochs=2", "logging.level=debug",
                        "checkpoint.resume=false", run_dir=tmp_path / "debug")).run()
    saves = [line for line in capfd.readouterr().err.splitlines() if "saved checkpoint" in line]
    assert [line.rsplit(" (", 1)[1] for line in saves] == ["end of epoch 0, step 45)", "end of epoch 1, step 90)"]
