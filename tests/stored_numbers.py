"""The one comparison of a fresh result with numbers stored earlier (a fixture, figures
written into a test or a docs page): what the golden-number tests share.

float32 results differ in the last bit between CPUs with the same code and torch (AVX-512
Xeons and AMD EPYCs: about 1e-8 relative on the digits runs' losses; DESIGN.md, "Machines
differ"), so a stored float matches at a relative tolerance of :data:`REL_TOL` = 1e-6: 100
times that rounding, far below what a change of behaviour moves. Everything else must be
equal: ints (step counts, skip counts), bools, strings and None exactly and of the same
type, dicts with the same keys, lists of the same length.

Where a run amplifies that rounding (fp16 AMP and int8 compression turn a last-bit
difference into a rounding quantum: up to 1e-5 relative after 3 epochs of the step records'
fp16 + int8 run), store the other CPU's numbers beside the first's, only for those runs, and
compare with each (:func:`assert_matches_one_of`) rather than widening the tolerance. A CPU
whose numbers are not stored yet must not fail a correct change (CI runs on whatever machine
a session gets): such a run passes within ``unknown_cpu_rel`` of a stored set, with an
:class:`UnknownCpuWarning` that prints its numbers to store.

Results computed in the same run (the native hook against the Python hook, a resumed run
against an uninterrupted one) are not stored numbers: those stay bit for bit.
"""

from __future__ import annotations

import json
import math
import warnings

REL_TOL = 1e-6
# Runs through fp16 AMP and int8 compression, on a CPU whose numbers are not stored: 10x the
# 1e-5 seen between two kinds of CPU by epoch 2 of the step records' fp16 + int8 run.
UNKNOWN_CPU_REL = 1e-4


class UnknownCpuWarning(UserWarning):
    """A run matched the stored numbers only within ``unknown_cpu_rel``: store its numbers."""


def differences(got, stored, rel: float = REL_TOL, where: str = "") -> list[str]:
    """Where ``got`` differs from ``stored`` beyond the tolerance, one line each (none: they match)."""
    here = where or "the value"
    if isinstance(stored, float) and type(got) is float:
        if got == stored or (math.isnan(got) and math.isnan(stored)) or math.isclose(got, stored, rel_tol=rel):
            return []
        off = abs(got - stored) / abs(stored) if stored else math.inf
        return [f"{here}: {got!r}, stored {stored!r} ({off:.2g} relative; tolerance {rel:g})"]
    if type(got) is not type(stored):
        return [f"{here}: {got!r} ({type(got).__name__}), stored {stored!r} ({type(stored).__name__})"]
    if isinstance(stored, dict):
        if got.keys() != stored.keys():
            return [f"{here}: keys {sorted(got)}, stored {sorted(stored)}"]
        return [line for key in stored
                for line in differences(got[key], stored[key], rel, f"{where}.{key}".lstrip("."))]
    if isinstance(stored, (list, tuple)):
        if len(got) != len(stored):
            return [f"{here}: {len(got)} items, stored {len(stored)}"]
        return [line for i, (g, s) in enumerate(zip(got, stored)) for line in differences(g, s, rel, f"{where}[{i}]")]
    return [] if got == stored else [f"{here}: {got!r}, stored {stored!r}"]


def assert_matches_one_of(got, stored_sets: list, rel: float = REL_TOL, unknown_cpu_rel: float = None) -> None:
    """``got`` matches one of ``stored_sets``, floats within ``rel`` relative: one set, or one per
    kind of CPU whose results differ by more than the tolerance; on failure, the differences
    from the closest set. With ``unknown_cpu_rel``, a result within that of a stored set passes
    too, with an :class:`UnknownCpuWarning` (a CPU whose numbers are not stored)."""
    assert stored_sets, "no stored numbers to compare with"
    diffs = [differences(got, stored, rel) for stored in stored_sets]
    closest = min(diffs, key=len)
    if closest and unknown_cpu_rel is not None and any(not differences(got, s, unknown_cpu_rel) for s in stored_sets):
        warnings.warn(UnknownCpuWarning(
            f"within {unknown_cpu_rel:g} of a stored set but not within {rel:g} of any: the rounding of a CPU whose "
            f"numbers are not stored (first difference: {closest[0]}); store these in the fixture's other_cpus: "
            f"{json.dumps(got)}"))
        return
    which = "the stored numbers" if len(diffs) == 1 else f"each of {len(diffs)} stored sets; from the closest"
    assert not closest, f"differs from {which}:\n" + "\n".join(closest)
