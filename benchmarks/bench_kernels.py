"""Fused kernels vs memcpy and vs plain torch (the code behind ``ddpx bench kernels``).

Bandwidth is (bytes read + bytes written) / best time of --repeats runs after a
warm-up; memcpy is torch ``dst.copy_(src)`` of the fp32 input size (on a GPU a
device-to-device copy), measured in the same run. Targets (issue 2): on one CPU
thread with 64 MB of fp32 input every fused kernel reaches 40% of memcpy and the
int8 / 1-bit kernels are 5x faster than plain torch; on a GPU 70% of the copy.

Usage: python benchmarks/bench_kernels.py [--size-mb 64] [--threads 1] [--device cpu]
                                          [--out FILE] [--check]
Prints one JSON object (``--out`` also writes it to FILE); ``--check`` exits 1
when a target is missed.
"""

import argparse
import json
import sys

from ddpx.bench import kernels
from ddpx.errors import DdpxError


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kernels.add_arguments(parser)
    parser.add_argument("--out", help="also write the JSON object to this file")
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(argv)
    try:
        result = kernels.measure_from_args(args)
    except DdpxError as exc:  # bad arguments: one line, as `ddpx bench kernels` says it
        print(f"bench_kernels: error: {exc}", file=sys.stderr)
        return exc.exit_code
    result["missed_targets"] = kernels.missed_targets(result)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for line in result["missed_targets"]:
        print(f"target missed: {line}", file=sys.stderr)
    return 1 if args.check and result["missed_targets"] else 0


if __name__ == "__main__":
    sys.exit(main())
