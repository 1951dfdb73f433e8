"""PowerSGD's orthogonalization of a piece's same-shape P's ([b, n, r], fp32), three ways:

* ``loop_qr``: ``torch.linalg.qr`` per matrix (the hook before issue 27);
* ``batched_qr``: one ``torch.linalg.qr`` of the batch (the hook now);
* ``gram_schmidt``: modified Gram-Schmidt over the batch, r steps of batched
  elementwise ops (torch's ``powerSGD_hook`` uses it for r <= 2).

Shapes: the char GPT example's (4 layers of 128 wide: P's of 384, 512 and 128 rows,
rank 4) and a 1024-wide model's. Time per call, the device synchronized around
``--repeat`` calls. QR and Gram-Schmidt agree up to column signs, which cancel in
PowerSGD's P Q^T; ``max_abs_diff`` checks that.

Usage: python benchmarks/bench_orthogonalize.py [--device cpu|cuda] [--repeat 50] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

from benchjson import emit

SHAPES = [(4, 384, 4), (4, 512, 4), (8, 128, 4), (1, 64, 4), (12, 1024, 4), (12, 1024, 1), (12, 1024, 2)]


def loop_qr_(p):
    import torch

    for i in range(p.shape[0]):
        p[i].copy_(torch.linalg.qr(p[i]).Q)


def batched_qr_(p):
    import torch

    p.copy_(torch.linalg.qr(p).Q)


def gram_schmidt_(p):
    import torch

    for i in range(p.shape[-1]):
        col = p[:, :, i:i + 1]
        col.div_(torch.linalg.vector_norm(col, dim=1, keepdim=True).clamp_min_(1e-30))
        if i + 1 < p.shape[-1]:
            rest = p[:, :, i + 1:]
            rest.sub_(col * (col * rest).sum(1, keepdim=True))


METHODS = {"loop_qr": loop_qr_, "batched_qr": batched_qr_, "gram_schmidt": gram_schmidt_}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device; run with --device cpu")

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    rows = []
    for b, n, r in SHAPES:
        p0 = torch.randn(b, n, r, generator=torch.Generator().manual_seed(b * n + r)).to(args.device)
        ref = p0.clone()
        loop_qr_(ref)
        row = {"shape": [b, n, r]}
        for name, fn in METHODS.items():
            p = p0.clone()
            fn(p)  # warm-up (cuSOLVER handles, workspaces)
            row[f"{name}_max_abs_diff"] = float((p.abs() - ref.abs()).abs().max())
            ps = [p0.clone() for _ in range(args.repeat)]
            sync()
            start = time.perf_counter()
            for p in ps:
                fn(p)
            sync()
            row[f"{name}_us"] = (time.perf_counter() - start) / args.repeat * 1e6
        rows.append(row)
    report = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}
    if not emit(report, args.out, args.json):
        for row in rows:
            print(row["shape"], ", ".join(f"{m} {row[m + '_us']:.0f} us" for m in METHODS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
