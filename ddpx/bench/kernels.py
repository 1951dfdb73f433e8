"""``ddpx bench kernels``: each fused kernel vs a memcpy and vs plain torch.

Bandwidth is (bytes read + bytes written) / time, the best of ``repeats``
timed runs after one warm-up run. The memcpy baseline is ``dst.copy_(src)`` of
two fp32 buffers of the input size (on a GPU: a device-to-device copy), counted
the same way (read + write); it is re-timed between kernels and the best kept. The plain-torch baseline is the same operation
written with torch ops (:mod:`ddpx.bench._reference`), timed in the same run.

On a GPU each timed run is many back-to-back calls timed with CUDA events,
cycling through enough copies of the inputs that they do not stay in the L2
cache: for the copy and the fused kernels one CUDA graph (so host overhead
does not hide a 4 MiB kernel), for the plain-torch references the eager calls
(what a user's code pays; some references sync and cannot be captured). The
low-rank passes are torch ops on CUDA, so both of their sides are eager.
"""

from __future__ import annotations

import json
import math
import time
from typing import Callable, Dict, List, Tuple

from ..errors import DdpxError

DEFAULT_SIZE_MB = 64.0
# On a GPU: a large input (the memory limit) and a DDP bucket (launch and tail effects).
DEFAULT_CUDA_SIZES_MB = (1024.0, 4.0)
DEFAULT_BLOCK = 1024


def register(subparsers):
    parser = subparsers.add_parser(
        "kernels",
        help="time the fused kernels against memcpy and plain torch",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser):
    """The options of ``ddpx bench kernels`` (shared with benchmarks/bench_kernels.py)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--size-mb", type=float, default=None, help="fp32 input size in MiB (default 64; on cuda 1024 and 4)"
    )
    parser.add_argument(
        "--sizes-mb", type=float, nargs="+", default=None, metavar="MB",
        help="several input sizes in one run (one result per size under \"runs\")",
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads; default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per kernel, best is kept (default 5)")
    parser.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK, help="int8 block and 1-bit chunk size (default 1024)"
    )
    parser.add_argument("--ranks", type=int, default=2, help="rows summed by the *_accumulate kernels (default 2)")
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="wall: elapsed time (default); thread: CPU time of this thread, which ignores time the "
        "OS gives to other processes (only for --device cpu --threads 1)",
    )


def run(args) -> int:
    result = measure_from_args(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("\n\n".join(format_table(r) for r in result.get("runs", [result])))
    return 0


def sizes_from_args(args) -> List[float]:
    """--sizes-mb, else --size-mb, else the device's default sizes."""
    if args.sizes_mb and args.size_mb is not None:
        raise DdpxError("give --size-mb or --sizes-mb, not both")
    if args.sizes_mb:
        return list(args.sizes_mb)
    if args.size_mb is not None:
        return [args.size_mb]
    return list(DEFAULT_CUDA_SIZES_MB) if args.device == "cuda" else [DEFAULT_SIZE_MB]


def measure_from_args(args) -> Dict:
    """One size: the result of :func:`measure`; several: {"runs": [one per size], ...}."""
    sizes = sizes_from_args(args)
    runs = [
        measure(
            size_mb=size,
            threads=args.threads,
            device=args.device,
            repeats=args.repeats,
            block_size=args.block_size,
            ranks=args.ranks,
            clock=args.clock,
        )
        for size in sizes
    ]
    if len(runs) == 1:
        return runs[0]
    return {"device": runs[0]["device"], "sizes_mb": sizes, "torch": runs[0]["torch"], "runs": runs}


def _check_args(size_mb, threads, device, repeats, block_size, ranks, clock):
    import torch

    if not size_mb > 0:
        raise DdpxError(f"--size-mb must be positive, got {size_mb}")
    if threads < 1:
        raise DdpxError(f"--threads must be at least 1, got {threads}")
    if repeats < 1:
        raise DdpxError(f"--repeats must be at least 1, got {repeats}")
    if block_size < 8 or block_size % 8:
        raise DdpxError(f"--block-size must be a positive multiple of 8 (1-bit chunks), got {block_size}")
    if ranks < 1:
        raise DdpxError(f"--ranks must be at least 1, got {ranks}")
    if clock == "thread" and (device != "cpu" or threads != 1):
        raise DdpxError("--clock thread counts only this thread's CPU time: use it with --device cpu --threads 1")
    if device not in ("cpu", "cuda"):
        raise DdpxError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda":
        from .. import _C

        if not torch.cuda.is_available():
            raise DdpxError("--device cuda but torch sees no CUDA device; run with --device cpu")
        if not _C.with_cuda:
            raise DdpxError("--device cuda but ddpx._C was built without CUDA; rebuild with DDPX_CUDA=1")


def _best_seconds(
    fn: Callable[[], object], repeats: int, sync: Callable[[], None], clock: Callable[[], float]
) -> float:
    fn()  # warm-up: page faults, caches, lazy initialisation
    sync()
    best = math.inf
    for _ in range(repeats):
        start = clock()
        fn()
        sync()
        best = min(best, clock() - start)
    return best


def _split_sizes(n: int) -> List[int]:
    """Deterministic mix of tiny to large tensor sizes summing to n (a model's parameters)."""
    sizes, total, i = [], 0, 0
    while total < n:
        size = min(n - total, (1 << (i % 18)) + 3 * i)
        sizes.append(size)
        total += size
        i += 1
    return sizes


def _cases(n: int, device: str, block: int, ranks: int) -> List[Dict]:
    """Each case: name, bytes moved (read + written), fused and plain-torch callables."""
    import torch

    from .. import ops
    from . import _reference as ref

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, generator=gen).to(device)
    err_fused, err_ref = torch.zeros_like(x), torch.zeros_like(x)
    nblocks = -(-n // block)
    out = torch.empty_like(x)
    half = ops.scale_cast(x, 0.5, torch.float16)
    bf16 = ops.scale_cast(x, 0.5, torch.bfloat16)
    half_out = torch.empty_like(half)
    bf16_out = torch.empty_like(bf16)
    q_rows = torch.randint(-127, 128, (ranks, n), generator=gen, dtype=torch.int8).to(device)
    q_scales = torch.rand(ranks, nblocks, generator=gen).to(device)
    bit_rows = torch.randint(0, 256, (ranks, (n + 7) // 8), generator=gen, dtype=torch.uint8).to(device)
    q_out, s_out = torch.empty(n, dtype=torch.int8, device=device), torch.empty(nblocks, device=device)
    b_out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=device)
    tensors = [t.clone() for t in torch.split(x, _split_sizes(n))]
    flat = torch.empty_like(x)
    # PowerSGD's passes: the input as a [rows, 1024] gradient matrix, its error memory, rank 4
    cols, rank = min(n, 1024), 4
    mat = x[: n // cols * cols].view(-1, cols).clone()
    mat_err = torch.zeros_like(mat)
    p_mat, p_prev = (torch.randn(mat.shape[0], rank, generator=gen).to(device) for _ in range(2))
    qt_mat = torch.randn(rank, cols, generator=gen).to(device)
    m4 = 4 * mat.numel()

    f4, b1, s4 = 4 * n, n, 4 * nblocks
    return [
        dict(name="scale_cast_fp16", bytes=f4 + 2 * n,
             fused=lambda: ops.scale_cast(x, 0.5, torch.float16, out=half_out),
             torch=lambda: ref.scale_cast(x, 0.5, torch.float16)),
        dict(name="scale_cast_bf16", bytes=f4 + 2 * n,
             fused=lambda: ops.scale_cast(x, 0.5, torch.bfloat16, out=bf16_out),
             torch=lambda: ref.scale_cast(x, 0.5, torch.bfloat16)),
        dict(name="cast_scale_copy_fp16", bytes=2 * n + f4,
             fused=lambda: ops.cast_scale_copy_(out, half, 2.0),
             torch=lambda: ref.cast_scale_copy_(out, half, 2.0)),
        dict(name="cast_scale_copy_bf16", bytes=2 * n + f4,
             fused=lambda: ops.cast_scale_copy_(out, bf16, 2.0),
             torch=lambda: ref.cast_scale_copy_(out, bf16, 2.0)),
        dict(name="int8_quantize", bytes=f4 + b1 + s4,
             fused=lambda: ops.int8_quantize(x, block, out_q=q_out, out_scales=s_out),
             torch=lambda: ref.int8_quantize(x, block)),
        dict(name="int8_quantize_error_feedback", bytes=3 * f4 + b1 + s4,
             fused=lambda: ops.int8_quantize(x, block, err_fused, out_q=q_out, out_scales=s_out),
             torch=lambda: ref.int8_quantize(x, block, err_ref)),
        dict(name=f"int8_dequant_accumulate_{ranks}ranks", bytes=ranks * (b1 + s4) + f4,
             fused=lambda: ops.int8_dequant_accumulate_(out, q_rows, q_scales, block),
             torch=lambda: ref.int8_dequant_accumulate_(out, q_rows, q_scales, block)),
        dict(name="onebit_pack_error_feedback", bytes=3 * f4 + n // 8 + s4,
             fused=lambda: ops.onebit_pack(x, block, err_fused, out_bits=b_out, out_scales=s_out),
             torch=lambda: ref.onebit_pack(x, block, err_ref)),
        dict(name=f"onebit_unpack_accumulate_{ranks}ranks", bytes=ranks * (n // 8 + s4) + f4,
             fused=lambda: ops.onebit_unpack_accumulate_(out, bit_rows, q_scales, block),
             torch=lambda: ref.onebit_unpack_accumulate_(out, bit_rows, q_scales, block)),
        dict(name=f"onebit_average_repack_{ranks}ranks", bytes=ranks * (n // 8 + s4) + 2 * f4 + n // 8 + s4,
             fused=lambda: ops.onebit_average_repack(bit_rows, q_scales, block, 1 / ranks, err_fused, b_out, s_out),
             torch=lambda: ref.onebit_pack(ref.onebit_unpack_accumulate_(out, bit_rows, q_scales, block, 1 / ranks),
                                           block, err_ref)),
        # torch: error += M; error -= P' Q'^T; P = error Q (3 passes) -- the fused kernel does it in one
        dict(name="lowrank_project_rank4", bytes=3 * m4,
             fused=lambda: ops.lowrank_project_(mat, mat_err, p_prev, qt_mat, p_mat),
             torch=lambda: torch.matmul(mat_err.add_(mat).addmm_(p_prev, qt_mat, alpha=-1), qt_mat.t(), out=p_mat)),
        dict(name="lowrank_transpose_project_rank4", bytes=m4,
             fused=lambda: ops.lowrank_transpose_project_(mat_err, p_mat, qt_mat),
             torch=lambda: torch.matmul(p_mat.t(), mat_err, out=qt_mat)),
        dict(name="lowrank_reconstruct_rank4", bytes=m4,
             fused=lambda: ops.lowrank_reconstruct_(mat, p_mat, qt_mat),
             torch=lambda: torch.matmul(p_mat, qt_mat, out=mat)),
        dict(name=f"flatten_{len(tensors)}tensors", bytes=2 * f4,
             fused=lambda: ops.flatten(tensors, out=flat),
             torch=lambda: torch.cat(tensors, out=flat)),
        dict(name=f"unflatten_{len(tensors)}tensors", bytes=2 * f4,
             fused=lambda: ops.unflatten_(flat, tensors),
             torch=lambda: ref.unflatten_(flat, tensors)),
    ]


def _cuda_seconds(fns: List[Callable[[], object]], repeats: int, iters: int, graph: bool) -> Tuple[float, str]:
    """Seconds per call of ``iters`` calls cycling through ``fns``: best of ``repeats``
    runs timed with CUDA events, each a CUDA graph replay (``graph``; eager calls where
    the calls cannot be captured) or the eager calls. Returns (seconds, "cuda_graph" or "eager")."""
    import torch

    calls = [fns[i % len(fns)] for i in range(iters)]

    def body():
        for fn in calls:
            fn()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph wants
        body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    runner, mode = body, "eager"
    if graph:
        try:
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                body()
            runner, mode = cuda_graph.replay, "cuda_graph"
        except Exception:  # an op that cannot be captured (a host sync): time the calls themselves
            torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(repeats):
        start.record()
        runner()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / iters)
    return best, mode


def _cuda_plan(n: int) -> Tuple[int, int]:
    """(input copies, calls per timed run) on the current GPU: enough copies that a
    call's inputs were evicted from L2 since their last use, enough calls that a run
    takes a while (at 4 MiB one call is a few microseconds)."""
    import torch

    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 64 << 20)
    copies = max(1, min(16, math.ceil(2 * l2 / (4 * n))))
    calls = max(copies, min(256, math.ceil((256 << 20) / (4 * n))))
    return copies, calls


def measure(
    size_mb: float = DEFAULT_SIZE_MB,
    threads: int = 1,
    device: str = "cpu",
    repeats: int = 5,
    block_size: int = DEFAULT_BLOCK,
    ranks: int = 2,
    clock: str = "wall",
) -> Dict:
    """Run the benchmark at one size; returns the ``--json`` object."""
    import torch

    _check_args(size_mb, threads, device, repeats, block_size, ranks, clock)
    timer = time.thread_time if clock == "thread" else time.perf_counter
    torch.set_num_threads(threads)
    n = max(1, int(size_mb * 2**20) // 4)
    cuda = device == "cuda"
    copies, calls = _cuda_plan(n) if cuda else (1, 1)

    pairs = [(torch.randn(n, device=device), torch.empty(n, device=device)) for _ in range(copies)]
    copy_fns = [lambda src=src, dst=dst: dst.copy_(src) for src, dst in pairs]
    modes = set()

    def seconds(fns, graph=True):
        if cuda:
            t, mode = _cuda_seconds(fns, repeats, calls, graph)
            modes.add(mode)
            return t
        return _best_seconds(fns[0], repeats, lambda: None, timer)

    def memcpy():
        return 8 * n / seconds(copy_fns) / 1e9

    # The copy is re-timed between kernels and the best kept, so a busy moment
    # during one copy measurement cannot flatter the ratios.
    memcpy_gbps = memcpy()
    with torch.no_grad():
        measured = []
        sets = [_cases(n, device, block_size, ranks) for _ in range(copies)]
        for i, case in enumerate(sets[0]):
            # plain torch: the eager calls a user's code makes (some references sync, e.g. a
            # host-to-device copy, and cannot be captured); the low-rank passes are torch
            # ops on CUDA too, so both sides are timed eagerly there
            fused_graph = not case["name"].startswith("lowrank_")
            gbps = case["bytes"] / seconds([cases[i]["fused"] for cases in sets], fused_graph) / 1e9
            ref_gbps = case["bytes"] / seconds([cases[i]["torch"] for cases in sets], False) / 1e9
            measured.append((case, gbps, ref_gbps))
            memcpy_gbps = max(memcpy_gbps, memcpy())
        del sets
    rows = [
        {
            "name": case["name"],
            "gbps": round(gbps, 3),
            "torch_reference_gbps": round(ref_gbps, 3),
            "ratio_to_memcpy": round(gbps / memcpy_gbps, 3),
            "speedup_vs_torch": round(gbps / ref_gbps, 2),
            "bytes": case["bytes"],
        }
        for case, gbps, ref_gbps in measured
    ]
    result = {
        "memcpy_gbps": round(memcpy_gbps, 3),
        "ops": rows,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "threads": threads,
        "size_mb": size_mb,
        "block_size": block_size,
        "ranks": ranks,
        "clock": clock,
        "torch": torch.__version__,
        "memcpy": "torch dst.copy_(src) of fp32 buffers of the input size, best over the run; "
        "GB/s = (bytes read + bytes written) / best time",
    }
    if cuda:
        result["timing"] = {
            "method": "+".join(sorted(modes)),
            "calls_per_run": calls,
            "input_copies": copies,
            "note": "each timed run: calls back to back cycling through the input copies (so they are not "
            "L2-resident), timed with CUDA events; the copy and the fused kernels as one CUDA graph, "
            "the plain-torch references and the low-rank passes (both sides) as eager calls",
        }
    return result


# Targets. CPU (one thread, 64 MB of fp32): every kernel at 40% of memcpy, the
# int8 / 1-bit kernels 5x plain torch. CUDA: the streaming kernels (casts,
# quantize, dequantize, pack, unpack) at 85% of the device-to-device copy for a
# large input and 60% for a DDP bucket (below CUDA_LARGE_MB: launch and tail
# effects count); flatten/unflatten of the many-tensor mix at 50% for the large
# input; the low-rank passes no slower than torch's matmul (5% timing noise).
CPU_MEMCPY_SHARE = 0.4
TORCH_SPEEDUP_TARGET = 5.0
CUDA_LARGE_MB = 256
CUDA_STREAMING_SHARE = {"large": 0.85, "bucket": 0.6}
CUDA_FLATTEN_SHARE = 0.5
CUDA_LOWRANK_VS_TORCH = 0.95
STREAMING_KERNELS = ("scale_cast", "cast_scale_copy", "int8_", "onebit_")


def missed_targets(result: Dict) -> List[str]:
    """One line per op that misses a target (empty when all are met); a result
    with several sizes ("runs") is checked size by size."""
    if "runs" in result:
        return [f"{run['size_mb']:g} MiB {line}" for run in result["runs"] for line in missed_targets(run)]
    return _cpu_misses(result) if result["device"] == "cpu" else _cuda_misses(result)


def _cpu_misses(result: Dict) -> List[str]:
    misses = []
    for op in result["ops"]:
        if op["ratio_to_memcpy"] < CPU_MEMCPY_SHARE:
            misses.append(f"{op['name']}: {op['ratio_to_memcpy']:.0%} of memcpy < {CPU_MEMCPY_SHARE:.0%}")
        if op["name"].startswith(("int8", "onebit")) and op["speedup_vs_torch"] < TORCH_SPEEDUP_TARGET:
            misses.append(f"{op['name']}: {op['speedup_vs_torch']:.1f}x plain torch < {TORCH_SPEEDUP_TARGET:g}x")
    return misses


def _cuda_misses(result: Dict) -> List[str]:
    large = result["size_mb"] >= CUDA_LARGE_MB
    streaming = CUDA_STREAMING_SHARE["large" if large else "bucket"]
    misses = []
    for op in result["ops"]:
        name, share = op["name"], op["ratio_to_memcpy"]
        if name.startswith(STREAMING_KERNELS) and share < streaming:
            misses.append(f"{name}: {share:.0%} of the copy < {streaming:.0%}")
        elif name.startswith(("flatten_", "unflatten_")) and large and share < CUDA_FLATTEN_SHARE:
            misses.append(f"{name}: {share:.0%} of the copy < {CUDA_FLATTEN_SHARE:.0%}")
        elif name.startswith("lowrank_") and op["speedup_vs_torch"] < CUDA_LOWRANK_VS_TORCH:
            misses.append(f"{name}: {op['speedup_vs_torch']:.2f}x torch's matmul < {CUDA_LOWRANK_VS_TORCH:g}x")
    return misses


def format_table(result: Dict) -> str:
    lines = [
        f"device {result['device']}, threads {result['threads']}, input {result['size_mb']:g} MiB fp32, "
        f"block {result['block_size']}, {result['clock']} clock, memcpy {result['memcpy_gbps']:.2f} GB/s (read + write)",
        f"{'kernel':<36} {'GB/s':>8} {'% memcpy':>9} {'torch GB/s':>11} {'speedup':>8}",
    ]
    for op in result["ops"]:
        lines.append(
            f"{op['name']:<36} {op['gbps']:>8.2f} {100 * op['ratio_to_memcpy']:>8.0f}% "
            f"{op['torch_reference_gbps']:>11.2f} {op['speedup_vs_torch']:>7.1f}x"
        )
    return "\n".join(lines)
