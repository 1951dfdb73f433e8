"""Fused kernels vs memcpy and vs plain torch (the code behind ``ddpx bench kernels``).

Bandwidth is (bytes read + bytes written) / best time of --repeats runs after a
warm-up; memcpy is torch ``dst.copy_(src)`` of the fp32 input size (on a GPU a
device-to-device copy), measured in the same run. On a GPU each run is a CUDA
graph of many calls timed with CUDA events (ddpx/bench/kernels.py).

Targets (``--check``; ddpx.bench.kernels.missed_targets):
- cpu (issue 2): on one thread with 64 MB of fp32 input every fused kernel
  reaches 40% of memcpy and the int8 / 1-bit kernels are 5x faster than plain torch;
- cuda (issue 32): casts, quantize, dequantize, pack and unpack at 85% of the
  copy at 1 GiB (any size >= 256 MiB) and 60% at 4 MiB; flatten/unflatten of
  the many-tensor mix (9378 tensors at 1 GiB) at 50% at 1 GiB; the low-rank
  passes no slower than torch's matmul (within 5%).

Usage: python benchmarks/bench_kernels.py [--size-mb 64 | --sizes-mb 1024 4] [--threads 1]
                                          [--device cpu] [--out FILE] [--check]
--device cuda measures 1024 and 4 MiB by default. Prints one JSON object
(``--out`` also writes it to FILE; several sizes: one result per size under
"runs"); ``--check`` exits 1 when a target is missed and names the kernels.
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
