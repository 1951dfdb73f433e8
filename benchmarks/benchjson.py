"""What the benchmark scripts do with their result: ``--out FILE`` writes it (indented
JSON, also when the text table is printed) and ``--json`` prints it as one line."""

from __future__ import annotations

import json


def emit(report: dict, out: str | None, as_json: bool) -> bool:
    """Write `report` to `out` when given, print it when `as_json`; True when printed
    (the caller then prints no table)."""
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    if as_json:
        print(json.dumps(report))
    return as_json
