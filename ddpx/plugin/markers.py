"""The plugin markers: ``@hookspec`` (in :mod:`ddpx.plugin.hookspecs`) and ``@hookimpl``
(what plugin authors use: ``from ddpx import hookimpl``).

A leaf module: it imports only pluggy, so the hook specs, the plugin manager,
the trainer's default hooks and every plugin can import the markers without
importing each other.
"""

import pluggy

PROJECT = "ddpx"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
