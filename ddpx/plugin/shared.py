"""What the plugins of one run share, typed: ``trainer.shared[KEY]``.

A plugin that offers something to the other plugins (or to the trainer) stores it under a
:class:`SharedKey`; a reader asks ``trainer.shared.get(KEY)`` and gets None where nothing was
stored (the plugin that would store it is blocked, or off). This is the one way plugins
share per-run state: not attributes set on the trainer, not another plugin looked up by
name. A third-party plugin defines keys of its own the same way, in its own module
(``MY_KEY = SharedKey[int]("mypkg.my_key", "what it holds")``). Modelled on pytest's
``Stash``.

The keys below are what ddpx's own plugins and the trainer share.
"""

from __future__ import annotations

from typing import Generic, Optional, TypeVar

T = TypeVar("T")


class SharedKey(Generic[T]):
    """A key of :class:`Shared`; ``T`` is the type of what it holds, ``doc`` who sets and who reads it."""

    __slots__ = ("name", "doc")

    def __init__(self, name: str, doc: str = ""):
        self.name, self.doc = name, doc

    def __repr__(self) -> str:
        return f"SharedKey({self.name!r})"


class Shared:
    """One run's shared state (``trainer.shared``), keyed by :class:`SharedKey` objects."""

    __slots__ = ("_values",)

    def __init__(self):
        self._values: dict = {}

    def __setitem__(self, key: SharedKey[T], value: T) -> None:
        self._values[key] = value

    def __getitem__(self, key: SharedKey[T]) -> T:
        try:
            return self._values[key]
        except KeyError:
            raise KeyError(f"nothing shared under {key.name!r} in this run ({key.doc})") from None

    def get(self, key: SharedKey[T], default: Optional[T] = None) -> Optional[T]:
        return self._values.get(key, default)

    def __contains__(self, key: SharedKey) -> bool:
        return key in self._values


LAST_FINITE_CHECKPOINT = SharedKey[str](
    "last_finite_checkpoint",
    "the newest checkpoint saved or resumed (all hold finite weights); set by the checkpoint plugin, named by "
    "the trainer when training diverges and handed to the trackers by the logging plugin")
ACCUMULATION_STEPS = SharedKey[int](
    "accumulation_steps",
    "micro-batches per optimizer step; set by the accumulation plugin, read by the checkpoint and comm monitor "
    "plugins (absent: 1)")
COMM_HOOK = SharedKey["ddpx.comm_hooks.CommState"](
    "comm_hook",
    "the run's comm state (ddpx.comm_hooks.CommState: the DDP hook's state, or fsdp's compressed reduce-scatter; "
    "its name, stats() with the wire bytes, pair(optimizer)); set by the comm_hook plugin, read by the logging and "
    "comm monitor plugins (absent: DDP's or FSDP's own reduction)")
EMA_WEIGHTS_FILE = SharedKey[str](
    "ema_weights_file",
    "the file the EMA weights were exported to at the end of training (rank 0); set by the ema plugin, handed to "
    "the trackers by the logging plugin")
