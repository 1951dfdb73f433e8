"""A metric to watch across epochs: best checkpoints (``checkpoint.monitor``) and
early stopping (``early_stopping.monitor``) use the same rules.

The name is a key of the epoch's metrics (``loss``, ``accuracy``, ``eval_loss``
when evaluation reports a loss, or any key a plugin adds). ``mode`` is
``max`` or ``min``; ``auto`` means ``min`` for names containing "loss" and
``max`` otherwise. Non-finite values never count as an improvement.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

from ..errors import DdpxError

MODES = ("auto", "max", "min")


class Monitor:
    def __init__(self, name: str, mode: str = "auto", min_delta: float = 0.0, section: str = "checkpoint"):
        if not isinstance(name, str) or not name:
            raise DdpxError(f"{section}.monitor must name an epoch metric (e.g. accuracy or eval_loss), got {name!r}")
        if mode not in MODES:
            raise DdpxError(f"{section}.mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not min_delta >= 0:
            raise DdpxError(f"{section}.min_delta must be >= 0, got {min_delta}")
        self.name = name
        self.mode = mode if mode != "auto" else ("min" if "loss" in name else "max")
        self.min_delta = float(min_delta)
        self.section = section

    @classmethod
    def from_config(cls, cfg: Mapping, section: str) -> Optional["Monitor"]:
        """The monitor a config section names (``monitor``, ``mode``, optional
        ``min_delta``), or None where ``monitor`` is null; a bad value, also a bad
        ``mode`` beside a null ``monitor``, is a one-line error."""
        if cfg["monitor"] is None:
            if cfg["mode"] not in MODES:
                raise DdpxError(f"{section}.mode must be one of {', '.join(MODES)}, got {cfg['mode']!r}")
            return None
        return cls(cfg["monitor"], cfg["mode"], cfg.get("min_delta", 0.0), section)

    def value(self, metrics: Mapping) -> Optional[float]:
        """The metric in ``metrics`` as a float, or None where it is missing."""
        value = metrics.get(self.name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return float(value)

    def improves(self, value: float, best: Optional[float]) -> bool:
        """Whether ``value`` is finite and beats ``best`` by more than ``min_delta``."""
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        if self.mode == "max":
            return value > best + self.min_delta
        return value < best - self.min_delta

    def describe(self) -> str:
        return f"{self.name} ({self.mode})"
