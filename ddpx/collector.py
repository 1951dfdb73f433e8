"""Python's garbage collector in a ddpx process: what torch loads is never examined again."""

import gc
import sys
from typing import Callable, NoReturn


def freeze_what_is_alive() -> None:
    """``gc.freeze()``: the objects alive now are left out of every later collection. torch
    brings about 300,000 of them, and each full collection walks them all: the ones during a
    run cost a worker about 0.4 s, the interpreter's last one at exit 0.7-1.2 s (after the
    run's last line). Called after the imports, before any model exists (a DDP model's cycles
    must stay collectable until its group is destroyed), and once more as the program ends;
    atexit handlers, module teardown and the streams' flushes still run."""
    gc.freeze()


def run_program(main: Callable[[], int]) -> NoReturn:
    """``sys.exit(main())`` for a process ddpx starts with torch imported (a rank)."""
    freeze_what_is_alive()
    code = main()
    freeze_what_is_alive()
    sys.exit(code)
