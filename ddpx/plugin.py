"""Plugin markers. ``from ddpx import hookimpl`` is what plugin authors use."""

import pluggy

PROJECT = "ddpx"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
