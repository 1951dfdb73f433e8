"""The old import path of :mod:`ddpx.comm_hooks`, kept for scripts that import it.

``import ddpx.hooks``, ``ddpx.hooks.register(...)`` and ``from ddpx.hooks.int8
import Int8State`` give the very same modules as ``ddpx.comm_hooks`` (not copies:
isinstance checks and saved states agree). New code imports ``ddpx.comm_hooks``;
"hooks" alone means the pluggy hooks of ddpx/plugin/hookspecs.py.
"""

import importlib
import pkgutil
import sys

from . import comm_hooks

for _module in pkgutil.iter_modules(comm_hooks.__path__):
    sys.modules[f"{__name__}.{_module.name}"] = importlib.import_module(f"{comm_hooks.__name__}.{_module.name}")
sys.modules[__name__] = comm_hooks
