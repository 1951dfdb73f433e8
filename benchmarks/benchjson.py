"""What the benchmark scripts share: how they read a hook spec from the command line, and
what they do with their result: ``--out FILE`` writes it (indented JSON, also when the text
table is printed) and ``--json`` prints it as one line."""

from __future__ import annotations

import json

import yaml


def emit(report: dict, out: str | None, as_json: bool) -> bool:
    """Write `report` to `out` when given, print it when `as_json`; True when printed
    (the caller then prints no table)."""
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    if as_json:
        print(json.dumps(report))
    return as_json


def hook_spec(spec: str, separator: str) -> tuple[str, dict]:
    """``'int8'`` or ``'int8:block_size=64<sep>piece_mb=2.0'`` -> ``(name, options)``; values read
    as YAML scalars, as ``ddpx train`` reads overrides (``64``, ``2.0``, ``true``)."""
    name, _, opts = spec.partition(":")
    options = {}
    for item in filter(None, opts.split(separator)):
        key, _, value = item.partition("=")
        options[key] = yaml.safe_load(value)
    return name, options
