"""``ddpx doctor --collectives``: real collectives between local processes, and a
consistency check of every comm hook (ranks must hold the same gradients), in both
scopes (ddpx/comm_hooks/scope.py): with 4 or more processes (an even count) they
are told, as torchrun would, that they are 2 nodes of half of them each, and every
lossy hook is checked with ``scope: inter_node`` too.

:func:`run_collectives` starts the ranks as ``python -m ddpx.doctor.probe``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from ..net import free_port, measure_allreduce_seconds, read_text
from .checks import FAIL, OK, Check

COLLECTIVE_BYTES = 32 << 20
RANK_MODULE = "ddpx.doctor.probe"  # what each of the local processes runs


def run_collectives(nproc: int, timeout_s: float = 120.0, nbytes: int = COLLECTIVE_BYTES,
                    hooks: Optional[Sequence[str]] = None) -> list[Check]:
    """Start ``nproc`` local gloo processes; run allreduce, barrier and every ddpx hook."""
    nproc = max(2, nproc)
    outdir = tempfile.mkdtemp(prefix="ddpx-doctor-")
    port = free_port()
    procs = []
    per_node = nproc // 2 if nproc >= 4 and nproc % 2 == 0 else nproc  # 2 pretend nodes: both scopes
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank % per_node),
                   GROUP_RANK=str(rank // per_node), LOCAL_WORLD_SIZE=str(per_node),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   DDPX_DOCTOR_OUT=outdir, DDPX_DOCTOR_BYTES=str(nbytes),
                   DDPX_DOCTOR_TIMEOUT=str(max(10, int(timeout_s / 2))))
        if hooks is not None:
            env["DDPX_DOCTOR_HOOKS"] = ",".join(hooks)
        log = open(os.path.join(outdir, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-m", RANK_MODULE], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    hung = [rank for rank, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    checks = _collective_report(outdir, procs, hung, timeout_s)
    if all(check.status != FAIL for check in checks):  # the ranks' logs are named only by a failure
        shutil.rmtree(outdir, ignore_errors=True)
    return checks


def _collective_report(outdir: str, procs, hung: list[int], timeout_s: float) -> list[Check]:
    results = []
    path = os.path.join(outdir, "rank0.jsonl")
    for line in read_text(path).splitlines():
        results.append(json.loads(line))
    checks = []
    for r in results:
        checks.append(Check(r["name"], r["status"], r["message"], r.get("fix", "")))
    if hung:
        stages = []
        for rank in hung:
            done = [json.loads(x)["name"] for x in read_text(os.path.join(outdir, f"rank{rank}.jsonl")).splitlines()]
            stages.append(f"rank {rank} after {done[-1] if done else 'start'}")
        checks.append(Check("collectives", FAIL, f"no result within {timeout_s:g} s: {'; '.join(stages)}",
                            "a collective hangs: run with GLOO_SOCKET_IFNAME/NCCL_DEBUG=INFO and check the logs in "
                            + outdir))
    failed = [rank for rank, p in enumerate(procs) if rank not in hung and p.returncode != 0]
    for rank in failed:
        tail = read_text(os.path.join(outdir, f"rank{rank}.log")).strip().splitlines()[-1:] or ["?"]
        checks.append(Check("collectives", FAIL, f"rank {rank} exited with {procs[rank].returncode}: {tail[0]}",
                            f"see {outdir}/rank{rank}.log"))
    if not checks:
        checks.append(Check("collectives", FAIL, "the ranks reported nothing", f"see the logs in {outdir}"))
    return checks


def _report(name, status, message, fix=""):
    out = os.environ["DDPX_DOCTOR_OUT"]
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"name": name, "status": status, "message": message, "fix": fix}) + "\n")


def _hook_consistency(name: str, rank: int, world: int, native: bool, scope: str = "global") -> tuple[str, str]:
    """Two DDP steps of a small multi-bucket model with hook ``name`` (the Python
    hook, or the native C++ one): ranks must agree. Returns (status, message)
    with the relative error of the first step vs the exact mean."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx.comm_hooks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    reference = [p.detach().clone() for p in model.parameters()]
    batches = []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 + r)
        batches.append((torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)))
    # the exact averaged gradient, computed locally from every rank's batch
    exact = [torch.zeros_like(p) for p in model.parameters()]
    for x, y in batches:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for e, p in zip(exact, model.parameters()):
            e += p.grad / world
    model.zero_grad()
    ddp = DDP(model, bucket_cap_mb=0.1)  # several buckets, the case that breaks naive hooks
    # check the compressed path itself, not the hook's warm-up of plain allreduce
    warm = ddpx.comm_hooks.without_warmup(name)
    if scope != "global":
        warm["scope"] = scope
    if native:
        state = ddpx.comm_hooks.register(ddp, name, native=True, **warm)
        if not getattr(state, "native", False):
            return OK, "no native implementation here; the Python hook is used instead"
    else:
        state, hook = ddpx.comm_hooks.make(name, **warm)
        ddp.register_comm_hook(state, hook)
    state.pair(None)  # no optimizer steps here: the auto options' values without one
    x, y = batches[rank]
    worst_spread, rel_err = 0.0, None
    for step in range(2):
        ddp.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if not torch.isfinite(flat).all():
            return FAIL, f"step {step}: non-finite gradients"
        hi, lo = flat.clone(), flat.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        worst_spread = max(worst_spread, float((hi - lo).abs().max()))
        if step == 0:
            exact_flat = torch.cat([e.reshape(-1) for e in exact])
            rel_err = float((flat - exact_flat).norm() / exact_flat.norm())
    for p, ref in zip(model.parameters(), reference):  # the hook must not touch parameters
        if not torch.equal(p.detach(), ref):
            return FAIL, "parameters changed during the backward pass"
    if worst_spread > 0:
        return FAIL, f"ranks hold different gradients (max difference {worst_spread:.3g}): models would diverge"
    exact_hook = name in ("allreduce", "fp32", "none", "default")
    if exact_hook and rel_err > 1e-5:
        return FAIL, f"gradient differs from the exact mean (relative error {rel_err:.2g})"
    return OK, f"ranks agree; relative error vs exact mean {rel_err:.2g} (2 steps, several buckets)"


def _collectives_rank() -> int:
    """One rank of ``--collectives`` (started by :func:`run_collectives`)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=float(os.environ.get("DDPX_DOCTOR_TIMEOUT", "60")))
    t0 = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    _report("init", OK, f"{world} gloo processes joined in {time.perf_counter() - t0:.2f} s")
    try:
        small = torch.full((1024,), float(rank + 1))
        dist.all_reduce(small)
        expected = world * (world + 1) / 2
        if torch.all(small == expected):
            _report("allreduce", OK, f"sum of {world} ranks correct ({expected:g})")
        else:
            _report("allreduce", FAIL, f"sum is {small[0].item():g}, expected {expected:g}",
                    "a broken transport: check the interface (GLOO_SOCKET_IFNAME) and MTU")
        t0 = time.perf_counter()
        dist.barrier()
        _report("barrier", OK, f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
        nbytes = int(os.environ.get("DDPX_DOCTOR_BYTES", COLLECTIVE_BYTES))
        seconds = measure_allreduce_seconds(nbytes)
        algbw = nbytes / seconds
        busbw = algbw * 2 * (world - 1) / world
        _report("bandwidth", OK, f"allreduce of {nbytes >> 20} MiB in {seconds * 1e3:.1f} ms: algorithm "
                f"{algbw / 1e9:.2f} GB/s, bus {busbw / 1e9:.2f} GB/s (loopback, {world} processes)")
        names = os.environ.get("DDPX_DOCTOR_HOOKS")
        if names is None:
            try:
                import ddpx.comm_hooks

                names = ",".join(ddpx.comm_hooks.available())
            except Exception as exc:  # noqa: BLE001 - reported, not fatal to the other checks
                _report("hooks", FAIL, f"ddpx.comm_hooks does not load: {exc}", "rebuild ddpx (pip install -e .)")
                names = ""
        two_level = int(os.environ.get("LOCAL_WORLD_SIZE", world)) not in (1, world)
        for name in filter(None, names.split(",")):
            scopes = ["global"] + (["inter_node"] if two_level and name != "allreduce" else [])
            for scope, native in [(s, n) for s in scopes for n in (False, True)]:
                label = f"hook {name}" + ("" if scope == "global" else f" {scope}") + (" native" if native else "")
                try:
                    status, message = _hook_consistency(name, rank, world, native, scope)
                except Exception as exc:  # noqa: BLE001 - a failing hook is a finding
                    first_line = (str(exc).splitlines() or [""])[0][:160]
                    status, message = FAIL, f"raised {type(exc).__name__}: {first_line}"
                fix = "" if status == OK else (f"do not use comm_hook.name={name}"
                                               + ("" if scope == "global" else f" with comm_hook.options.scope={scope}")
                                               + (" with comm_hook.native=true" if native else ""))
                _report(label, status, message, fix)
    finally:
        from ..rank import process_group

        process_group.teardown()  # the hooks' DDP models go before their process group
    return 0


if __name__ == "__main__":
    from ..collector import run_program

    run_program(_collectives_rank)
