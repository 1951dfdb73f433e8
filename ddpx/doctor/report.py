"""The ``ddpx doctor`` report: text, JSON summary and exit code."""

from __future__ import annotations

from dataclasses import asdict
from typing import Sequence

from .checks import FAIL, OK, WARN, Check


def summarize(checks: Sequence[Check]) -> dict:
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL)}
    return {"ok": counts[FAIL] == 0, "counts": counts, "checks": [asdict(c) for c in checks]}


def format_text(checks: Sequence[Check]) -> str:
    width = max((len(c.name) for c in checks), default=10)
    lines = [c.line(width) for c in checks]
    s = summarize(checks)["counts"]
    lines.append(f"{s[OK]} OK, {s[WARN]} WARN, {s[FAIL]} FAIL")
    return "\n".join(lines)


def exit_code(checks: Sequence[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0
