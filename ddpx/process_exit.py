"""A program's quick exit: the interpreter's last garbage collection skipped."""

import gc


def skip_final_collection() -> None:
    """Call as a program ends. After torch loaded, the interpreter's exit spends about 1 s
    of CPU collecting its objects (0.7 s for ``import torch`` alone, more with DDP's
    torch._dynamo), after the run's last line. Frozen, they are left to the operating
    system; atexit handlers, module teardown and the streams' flushes still run."""
    gc.freeze()
