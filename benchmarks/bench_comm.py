"""DDP step time with each comm hook on a bandwidth-limited network.

Loopback is not a network: on it compression only adds work. This benchmark
builds N "hosts" as Linux network namespaces joined by a bridge, shapes every
link with ``tc qdisc ... tbf rate RATE`` (both directions), runs one torchrun
node per namespace (``GLOO_SOCKET_IFNAME`` set, master = the first host) and
times DDP steps of a communication-bound model (12 x Linear(1024, 1024),
about 50 MB of fp32 gradients) for: no hook, a hook that does nothing (no
communication, no work: what DDP alone costs over the compute, the floor of
every hook's /bound; its gradients are not averaged), torch's fp16_compress_hook,
torch's PowerSGD (its failure is reported if it fails), and every ddpx hook,
native and Python, in two settings (``--settings``): ``defaults``, what most
users write (``DDP(model)`` with DDP's defaults: 25 MB buckets, gradients
copied out of the buckets, then ``ddpx.comm_hooks.register``), and ``tuned``, with
the DDP options the hook asks for (``ddpx.comm_hooks.ddp_options``: gradients as
bucket views, 4 MB buckets for int8), as the ddpx trainer applies them.
torch's configs get DDP's defaults; ``--bucket-mb`` sets one size for every
config.

It reports the DDP setting, the bucket size, ms/step, the speed-up over plain allreduce and over
torch's fp16 hook in the same run, a defaults row's step time over its tuned twin's
(``/tuned``), the bytes each rank sends per step, and the step time
the link allows: compute + wire bytes / rate, where compute is the median
forward + backward step without DDP, measured in blocks of 5 steps that
alternate with the config's timed steps (so both see the same machine; a
block, not single steps, so that each keeps its caches warm). It also reports
rank 0's CPU time per step (all its threads) and how busy the whole machine was
during the timed steps: near 100 %, the CPU, not the link, sets the step time.

    sudo python benchmarks/bench_comm.py                  # 2 hosts, 1 Gbit/s
    sudo python benchmarks/bench_comm.py --hosts 3 --rate 500mbit --json

On a real cluster, skip the namespaces and run the worker under torchrun:

    torchrun --nnodes 2 --nproc_per_node 1 ... benchmarks/bench_comm.py --worker --rate-bps 1e9

Namespaces (``ddpxbench<pid>-*``, addresses 10.213.0.0/24 inside them only;
``DDPX_TEST_NETNS=NSPREFIX,VETHPREFIX,A.B`` picks the name prefix and the /16,
for machines shared with others) are removed on exit, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchjson import hook_spec

_NETNS = os.environ.get("DDPX_TEST_NETNS", "ddpxbench,vt,10.213").split(",")
SUBNET = f"{_NETNS[2]}.0"
SETTINGS = ("defaults", "tuned")
PORT = 29513


# ----------------------------------------------------------------- worker
DEFAULT_BUCKET_MB = 25.0  # DistributedDataParallel's bucket_cap_mb
BLOCK_STEPS = 5  # timed steps per block; blocks with and without DDP alternate


def _configs(names, settings=SETTINGS, paths=("native", "python"), scopes=("global",)):
    """(label, kind, name, native, setting, scope) in run order; torch's PowerSGD last (it may crash the group).
    A hook's scopes follow one another, so that their ratio compares neighbours in time."""
    import ddpx.comm_hooks

    out = [("no hook", "none", None, None, "defaults", None), ("DDP only: no-op hook", "noop", None, None, "tuned", None),
           ("torch fp16_compress_hook", "torch", "fp16", None, "defaults", None)]
    for spec in names if names is not None else ddpx.comm_hooks.available():
        for path in paths:
            for setting in settings:
                for scope in scopes if _parse_spec(spec)[0] != "allreduce" else ("global",):
                    suffix = "" if scope == "global" else f" {scope}"
                    out.append((f"ddpx {spec} {path}{suffix}", "ddpx", spec, path == "native", setting, scope))
    out.append(("torch powerSGD rank 4", "torch", "powersgd", None, "defaults", None))
    return out


def _parse_spec(spec):
    """'int8' or 'int8:block_size=128,compress_vectors=true' -> (name, options)."""
    return hook_spec(spec, ",")


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])


def _ring(nbytes, world):
    return 2 * (world - 1) * nbytes / world


def _torch_wire_bytes(name, model, world, rank=4):
    params = list(model.parameters())
    if name == "fp16":
        return _ring(2 * sum(p.numel() for p in params), world)
    total = 0
    for p in params:  # PowerSGD: P (n x r) and Q (m x r) per matrix, vectors uncompressed
        if p.dim() > 1:
            n, m = p.shape[0], p.numel() // p.shape[0]
            total += 4 * rank * (n + m)
        else:
            total += 4 * p.numel()
    return _ring(total, world)


def _noop_hook(_, bucket):
    """Leaves the bucket as it is: DDP's own cost, without communication."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _cpu_ticks():
    """(busy, total) CPU ticks of the whole machine so far (Linux /proc/stat; zeros elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


def _replicas_identical(ddp) -> bool:
    """Whether every rank holds the same gradients, bit for bit (after the last timed step)."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for p in ddp.parameters() if p.grad is not None])
    mine = torch.tensor([int(flat.view(torch.int32).to(torch.int64).sum()), int(flat.numel())])
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(e, everyone[0]) for e in everyone)


def worker(args):
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx.comm_hooks
    from ddpx.rank import process_group

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(args.batch, 1024)
    results = {"world_size": world, "rate_bps": args.rate_bps, "steps": args.steps, "results": [],
               "nproc_per_host": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}

    def save():
        if rank == 0 and args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(results, f)
            os.replace(args.out + ".tmp", args.out)

    net = _model()

    def timed_step(model, cpu=None):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        model.zero_grad()
        model(x).square().mean().backward()
        if cpu is not None:
            cpu.append(time.process_time() - c0)
        return time.perf_counter() - t0

    n_params = sum(p.numel() for p in net.parameters())
    results["grad_bytes"] = 4 * n_params
    save()
    timed_step(net)  # untimed: the first step allocates

    for label, kind, name, native, setting, scope in _configs(args.hooks, args.settings.split(","),
                                                              args.paths.split(","), args.scopes.split(",")):
        # The host's speed drifts during a run, so every config's bound uses the
        # compute time measured in step with it (the header shows the range).
        entry = {"label": label, "kind": kind, "name": name, "native": native, "setting": setting, "scope": scope}
        results["results"].append(entry)
        save()  # if this config kills the process, the parent knows which one it was
        # each config as a user gets it: DDP(model) as most write it, or with the DDP
        # options the hook asks for (as the ddpx trainer applies them)
        options = ddpx.comm_hooks.ddp_options(_parse_spec(name)[0]) if kind == "ddpx" and setting == "tuned" else {}
        if kind == "noop":
            options = ddpx.comm_hooks.ddp_options("allreduce")  # the DDP options of ddpx's plainest hook
        if args.bucket_mb is not None:
            options["bucket_cap_mb"] = args.bucket_mb
        entry["bucket_mb"] = options.get("bucket_cap_mb", DEFAULT_BUCKET_MB)
        ddp = DDP(_model(), **options)
        state = None
        try:
            if kind == "ddpx":
                hook_name, hook_options = _parse_spec(name)
                # time the compressed path, not the warm-up (unless the spec sets warmup_steps)
                hook_options = {**ddpx.comm_hooks.without_warmup(hook_name), **hook_options}
                if scope != "global":
                    hook_options["scope"] = scope
                state = ddpx.comm_hooks.register(ddp, hook_name, native=native, **hook_options)
                state.pair(None)  # no optimizer steps here: int8's block_size auto is 256, powersgd's rank 4
                entry["native"] = state.native
            elif kind == "noop":
                ddp.register_comm_hook(None, _noop_hook)
            elif kind == "torch" and name == "fp16":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif kind == "torch" and name == "powersgd":
                ps = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                 start_powerSGD_iter=2, warm_start=True)
                ddp.register_comm_hook(ps, powerSGD_hook.powerSGD_hook)
            for _ in range(args.warmup):  # DDP's bucket rebuild, the hooks' warm-up
                timed_step(ddp)
            before = state.stats() if state is not None else None
            times, alone, cpu, busy = [], [], [], [0, 0]
            while len(times) < args.steps:
                block = min(BLOCK_STEPS, args.steps - len(times))
                alone += [timed_step(net) for _ in range(block)]  # the same model without DDP
                before_ticks = _cpu_ticks()
                times += [timed_step(ddp, cpu) for _ in range(block)]
                busy = [a + b - c for a, b, c in zip(busy, _cpu_ticks(), before_ticks)]
            entry["compute_ms"] = statistics.median(alone) * 1e3
            entry["ms_per_step"] = statistics.median(times) * 1e3
            entry["ms_mean"] = statistics.mean(times) * 1e3
            # where the machine, not the link, is the limit: this rank's CPU time (all its
            # threads) per step, and how busy the whole machine was during the timed steps
            entry["cpu_ms"] = statistics.median(cpu) * 1e3
            entry["machine_busy"] = busy[0] / busy[1] if busy[1] else None
            if state is not None:
                after = state.stats()
                entry["wire_bytes"] = (after["wire_bytes"] - before["wire_bytes"]) / args.steps
                entry["replicas_identical"] = _replicas_identical(ddp)
            elif kind == "none":
                entry["wire_bytes"] = _ring(4 * n_params, world)
            elif kind == "noop":
                entry["wire_bytes"] = 0
            else:
                entry["wire_bytes"] = _torch_wire_bytes(name, ddp.module, world)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            # torch nests callback errors ("Got the following error when running the callback: ...")
            text = re.sub(r"(\w+Error: )?Got the following error when running the callback: ", "", str(exc))
            entry["error"] = f"{type(exc).__name__}: {text.splitlines()[0][:200]}"
            save()
            if kind == "torch" and name == "powersgd":
                break  # the group may be out of step now; it is the last config anyway
            raise
        save()
        del ddp, state
    save()
    dist.barrier()
    process_group.teardown()
    return results


# ------------------------------------------------------------------ table
def summarize(results, rate_bps):
    """Add speed-ups and the link-bound step time to every entry."""
    by = {(e["label"], e.get("setting", "tuned" if e.get("kind") in ("ddpx", "noop") else "defaults")): e
          for e in results["results"]}
    plain = by.get(("no hook", "defaults"), {}).get("ms_per_step")
    tfp16 = by.get(("torch fp16_compress_hook", "defaults"), {}).get("ms_per_step")
    for e in results["results"]:
        ms = e.get("ms_per_step")
        if ms is None:
            continue
        e["speedup_vs_allreduce"] = plain / ms if plain else None
        e["speedup_vs_torch_fp16"] = tfp16 / ms if tfp16 else None
        tuned = by.get((e["label"], "tuned"), {}).get("ms_per_step") if e.get("setting") == "defaults" else None
        e["vs_tuned"] = ms / tuned if tuned else None
        # an inter_node config against its global twin: same hook, path and setting, same run
        twin = by.get((e["label"][: -len(" " + e["scope"])], e.get("setting")), {}).get("ms_per_step") \
            if e.get("scope") not in (None, "global") else None
        e["vs_global"] = ms / twin if twin else None
        if rate_bps and "wire_bytes" in e:
            e["link_bound_ms"] = e["compute_ms"] + e["wire_bytes"] * 8 / rate_bps * 1e3
            e["vs_link_bound"] = ms / e["link_bound_ms"]
    return results


def table(results):
    rows = [("hook", "DDP", "bucket MB", "ms/step", "CPU ms", "busy", "x allreduce", "x torch fp16", "/tuned",
             "/global", "wire MB/step", "link-bound ms", "/bound")]
    notes = []
    for e in results["results"]:
        setting = e.get("setting", "")
        if "ms_per_step" not in e:
            rows.append((e["label"], setting, f"{e.get('bucket_mb', DEFAULT_BUCKET_MB):g}", "FAILED", "", "", "", "",
                         "", "", "", "", ""))
            notes.append(f"{e['label']} ({setting}): {e.get('error', 'did not finish')}")
            continue
        rows.append((
            e["label"] + ("" if e.get("native") in (None, " native" in e["label"]) else " (fell back)"),
            setting,
            f"{e.get('bucket_mb', DEFAULT_BUCKET_MB):g}",
            f"{e['ms_per_step']:.1f}",
            f"{e['cpu_ms']:.0f}" if e.get("cpu_ms") is not None else "",
            f"{e['machine_busy']:.0%}" if e.get("machine_busy") is not None else "",
            f"{e['speedup_vs_allreduce']:.2f}" if e.get("speedup_vs_allreduce") else "",
            f"{e['speedup_vs_torch_fp16']:.2f}" if e.get("speedup_vs_torch_fp16") else "",
            f"{e['vs_tuned']:.2f}" if e.get("vs_tuned") else "",
            f"{e['vs_global']:.2f}" if e.get("vs_global") else "",
            f"{e['wire_bytes'] / 1e6:.1f}" if "wire_bytes" in e else "",
            f"{e['link_bound_ms']:.1f}" if "link_bound_ms" in e else "",
            f"{e['vs_link_bound']:.2f}" if "vs_link_bound" in e else "",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    notes.insert(0, "DDP: defaults = DDP(model) + ddpx.comm_hooks.register (25 MB buckets, .grad copied out); "
                 "tuned = DDP(model, **ddpx.comm_hooks.ddp_options(name)); /global: an inter_node row's step over "
                 "its global twin's; wire MB: across nodes only for inter_node rows; CPU ms: rank 0's CPU time per step, all "
                 "its threads; busy: the whole machine's CPU use during the timed steps (near 100%: the machine, not "
                 "the link, sets the step time)")
    if any(e.get("replicas_identical") is False for e in results["results"]):
        notes.append("REPLICAS DIFFER after: " + ", ".join(e["label"] for e in results["results"]
                                                         if e.get("replicas_identical") is False))
    head = (f"{results['world_size']} ranks ({results.get('nproc_per_host', 1)} per host), "
            f"{results['rate_bps'] / 1e9:g} Gbit/s links, "
            f"compute alone {_compute_range(results)} ms/step, gradients {results['grad_bytes'] / 1e6:.1f} MB, "
            f"median of {results['steps']} steps")
    return head + "\n" + "\n".join(lines + notes)


def _compute_range(results):
    """'31.2' or '29.8-33.1': compute alone as measured with each config."""
    times = [e["compute_ms"] for e in results["results"] if "compute_ms" in e]
    if not times:
        return "not measured"
    low, high = min(times), max(times)
    return f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f}"


# ------------------------------------------------------------- namespaces
def parse_rate(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)", rate.lower())
    if not m:
        raise SystemExit(f"bench_comm: --rate {rate!r} is not a tc rate like 1gbit or 500mbit")
    mult = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return float(m.group(1)) * mult * (8 if m.group(3) == "bps" else 1)


class Namespaces:
    """N hosts + a switch namespace holding the bridge; removed by close()."""

    def __init__(self, hosts: int, rate: str):
        self.prefix = f"{_NETNS[0]}{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(hosts)]
        self.rate = rate
        self.created: list[str] = []

    def sh(self, *cmd):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")

    def addr(self, i):
        return f"{SUBNET}.{i + 1}"

    def open(self):
        self.sh("ip", "netns", "add", self.switch)
        self.created.append(self.switch)
        sw = ["ip", "netns", "exec", self.switch]
        self.sh(*sw, "ip", "link", "add", "br0", "type", "bridge")
        self.sh(*sw, "ip", "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            self.sh("ip", "netns", "add", host)
            self.created.append(host)
            hx = ["ip", "netns", "exec", host]
            port = f"p{i}"
            self.sh("ip", "link", "add", "eth0", "netns", host, "type", "veth", "peer", "name", port, "netns",
                    self.switch)
            self.sh(*hx, "ip", "link", "set", "lo", "up")
            self.sh(*hx, "ip", "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            self.sh(*hx, "ip", "link", "set", "eth0", "up")
            self.sh(*sw, "ip", "link", "set", port, "master", "br0")
            self.sh(*sw, "ip", "link", "set", port, "up")
            tbf = ["root", "tbf", "rate", self.rate, "burst", "1mb", "latency", "100ms"]
            self.sh(*hx, "tc", "qdisc", "add", "dev", "eth0", *tbf)  # host -> switch
            self.sh(*sw, "tc", "qdisc", "add", "dev", port, *tbf)  # switch -> host
        return self

    def close(self):
        for ns in reversed(self.created):
            # torchrun starts its workers in sessions of their own, so killing a host's
            # process group can leave a hung worker behind: kill all that runs in the namespace
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created = []


def _death_reason(tmp, hosts):
    """The first fatal line a dead worker printed (e.g. gloo's enforce message)."""
    for i in range(hosts):
        try:
            text = open(os.path.join(tmp, f"host{i}.log")).read()
        except OSError:
            continue
        for line in text.splitlines():
            if "what():" in line or "Error:" in line and "ChildFailedError" not in line:
                return line.strip()[:240]
    return "no message (see the worker logs)"


def refuse_without_rights():
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("bench_comm: needs the `ip` and `tc` tools (iproute2) to build network namespaces; "
                         "install iproute2, or run the worker under torchrun on real hosts (--worker)")
    if os.geteuid() != 0:
        raise SystemExit("bench_comm: creating network namespaces needs root (CAP_NET_ADMIN); run it with sudo, "
                         "or run the worker under torchrun on real hosts (--worker)")
    probe = f"ddpxbench{os.getpid()}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_comm: cannot create network namespaces here ({r.stderr.strip()}); "
                         "run as root on a Linux host, or run the worker under torchrun (--worker)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2, help="network-namespace hosts")
    p.add_argument("--nproc-per-host", type=int, default=1,
                   help="ranks per host (loopback between them, the shaped link between hosts)")
    p.add_argument("--scopes", default="global",
                   help="scope options of the ddpx hooks to time: global, inter_node, auto (comma-separated; "
                        "inter_node needs --nproc-per-host 2 or more)")
    p.add_argument("--rate", default="1gbit", help="link rate per direction, tc syntax (default 1gbit)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per hook")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per hook (bucket rebuild, warm-up)")
    p.add_argument("--batch", type=int, default=8, help="samples per rank (small: communication-bound)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="DDP bucket_cap_mb for every config (default: torch's 25, or a ddpx hook's preferred "
                        "size from ddpx.comm_hooks.ddp_options, as the ddpx trainer uses it)")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help="DDP settings of the ddpx hooks: defaults (DDP(model)), tuned (ddp_options); default both")
    p.add_argument("--paths", default="native,python", help="ddpx hook paths to time: native, python (default both)")
    p.add_argument("--hooks", nargs="*", default=None,
                   help="ddpx hooks to time, NAME or NAME:opt=value,... (default: all available)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    p.add_argument("--collective-timeout", type=float, default=60)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--worker", action="store_true", help="run as a torchrun worker (no namespaces)")
    p.add_argument("--rate-bps", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for value, known, flag in ((args.settings, SETTINGS, "--settings"), (args.paths, ("native", "python"), "--paths"),
                               (args.scopes, ("global", "inter_node", "auto"), "--scopes")):
        bad = [v for v in value.split(",") if v not in known]
        if bad or not value:
            p.error(f"{flag}: unknown {', '.join(bad) or 'empty value'}; choose from {', '.join(known)}")

    if args.worker:
        if args.rate_bps is None:
            args.rate_bps = parse_rate(args.rate)
        results = worker(args)
        if int(os.environ.get("RANK", "0")) == 0 and args.out is None:  # torchrun on real hosts
            results = summarize(results, args.rate_bps)
            print(json.dumps(results, indent=2) if args.json else table(results))
        return 0

    if args.hosts < 2:
        raise SystemExit("bench_comm: --hosts must be at least 2")
    rate_bps = parse_rate(args.rate)
    refuse_without_rights()
    nets = Namespaces(args.hosts, args.rate)
    procs: list[subprocess.Popen] = []

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    tmp = tempfile.mkdtemp(prefix="ddpx-bench-comm-")
    out_file = os.path.join(tmp, "results.json")
    try:
        nets.open()
        here = os.path.abspath(__file__)
        for i, host in enumerate(nets.hosts):
            cmd = ["ip", "netns", "exec", host, sys.executable, "-m", "torch.distributed.run",
                   f"--nnodes={args.hosts}", f"--node_rank={i}", f"--nproc_per_node={args.nproc_per_host}",
                   f"--master_addr={nets.addr(0)}", f"--master_port={PORT}",
                   here, "--worker", "--rate-bps", str(rate_bps), "--out", out_file,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
                   "--threads", str(args.threads), "--collective-timeout", str(args.collective_timeout),
                   "--settings", args.settings, "--paths", args.paths, "--scopes", args.scopes]
            if args.bucket_mb is not None:
                cmd += ["--bucket-mb", str(args.bucket_mb)]
            if args.hooks is not None:
                cmd += ["--hooks", *args.hooks]
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS=str(args.threads))
            log = open(os.path.join(tmp, f"host{i}.log"), "w")
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.time() + args.timeout
        stall_s = max(120.0, 2 * args.collective_timeout)
        while any(pr.poll() is None for pr in procs) and time.time() < deadline:
            time.sleep(0.5)
            # rank 0 rewrites the results file when each config starts and ends: a config
            # silent for longer than any step could take is hung (torch's PowerSGD on gloo
            # can deadlock where gloo's own timeout never fires)
            if os.path.exists(out_file) and time.time() - os.path.getmtime(out_file) > stall_s:
                break
        hung = any(pr.poll() is None for pr in procs)
        failed = [i for i, pr in enumerate(procs) if pr.returncode not in (0, None)]
    finally:
        for pr in procs:
            if pr.poll() is None:
                os.killpg(pr.pid, signal.SIGKILL)
                pr.wait()
        nets.close()
        for s, h in old.items():
            signal.signal(s, h)

    if not os.path.exists(out_file):
        logs = "".join(open(os.path.join(tmp, f"host{i}.log")).read()[-2000:] for i in range(args.hosts))
        raise SystemExit(f"bench_comm: the workers produced no results; their output:\n{logs}")
    with open(out_file) as f:
        results = summarize(json.load(f), rate_bps)
    died = _death_reason(tmp, args.hosts)
    for e in results["results"]:
        if "ms_per_step" not in e and "error" not in e:
            e["error"] = "hung (no progress for 2 x --collective-timeout, at least 120 s: killed)" if hung \
                else f"the worker process died: {died}"
    if failed or hung:
        results["worker_logs"] = tmp
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(table(results))
        if failed or hung:
            print(f"(worker logs: {tmp})")
    if not (failed or hung):
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
