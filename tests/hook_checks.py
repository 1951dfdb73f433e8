"""What the comm-hook tests share: the hook names under test, the tolerances of the
lossy ones, and the comparisons (test modules do not import each other)."""

import torch

LOSSY = ["fp16", "bf16", "int8"]
ALL = ["allreduce"] + LOSSY
PART2 = ["onebit", "powersgd"]  # most of their tests are in test_hooks_part2.py
# max |hook - exact| / max |exact| per parameter after one step (first step: no error feedback yet)
REL_TOL = {"fp16": 2e-3, "bf16": 2e-2, "int8": 3e-2}


def equal_lists(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def max_rel_err(got, ref):
    return max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-12)) for g, r in zip(got, ref))
