"""The options of the compression methods: one :class:`Option` per key, checked once.

A method's descriptor (ddpx/comm_hooks/registry.py, ``Method.options``) holds the one dict
of its options; its DDP state and its sharded form take them from there, so a bad value
is the same one-line :class:`ddpx.DdpxError` whichever asks. An option whose default is
``"auto"`` and that names its two values in ``auto`` (int8's ``block_size``, powersgd's
``rank``) is resolved by pairing the state with its optimizer
(ddpx/comm_hooks/comm_state.py, ``CommState.pair``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import DdpxError


@dataclass(frozen=True)
class Option:
    """One option: type, default, a check returning an error text or None, a doc line, and
    for an ``"auto"`` option that depends on the optimizer ``auto = (value without, value
    with an Adam-family optimizer)``."""

    type: type
    default: Any
    check: Callable[[Any], str | None] | None = None
    doc: str = ""
    auto: tuple | None = None


def validate_options(what: str, options: dict[str, Option], opts: dict) -> dict:
    """``opts`` checked against ``options`` and completed with the defaults; a bad one is a
    :class:`DdpxError` starting with ``what`` (e.g. ``comm hook 'int8'``)."""
    unknown = sorted(set(opts) - set(options))
    if unknown:
        known = ", ".join(sorted(options)) or "none"
        raise DdpxError(f"{what}: unknown option(s) {', '.join(unknown)}; known options: {known}")
    out = {}
    for key, spec in options.items():
        v = opts.get(key, spec.default)
        if spec.type is bool:
            ok = isinstance(v, bool)
        elif spec.type is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif spec.type is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            v = float(v) if ok else v
        else:
            ok = isinstance(v, spec.type)
        if not ok:
            raise DdpxError(f"{what}: option {key} must be {spec.type.__name__}, got {v!r} ({type(v).__name__})")
        problem = spec.check(v) if spec.check else None
        if problem:
            raise DdpxError(f"{what}: option {key} {problem}, got {v!r}")
        out[key] = v
    return out


def non_negative(v):
    return None if v >= 0 else "must be >= 0"


def positive_multiple_of(k):
    def check(v):
        return None if v > 0 and v % k == 0 else f"must be a positive multiple of {k}"

    return check


SCOPE = Option(str, "global", lambda v: None if v in ("global", "inter_node", "auto") else
               "must be global, inter_node or auto", "where the compressed reduction runs (ddpx/comm_hooks/scope.py)")

# The options every lossy DDP hook takes (ddpx/comm_hooks/state.py, LossyState).
LOSSY = {
    "warmup_steps": Option(int, 0, non_negative, "iterations of plain fp32 allreduce before compression starts"),
    "min_numel": Option(int, 1024, non_negative, "parameters with fewer elements are sent uncompressed"),
    "compress_vectors": Option(bool, False, None, "compress 1-D parameters (biases, norms) too"),
    "scope": SCOPE,
}

