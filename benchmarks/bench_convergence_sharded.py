"""Does ``trainer.strategy: fsdp`` train as well as ddp? Final eval loss of ``ddpx train``
on 2 gloo ranks, per project, strategy and seed, against ddp's.

Targets (issue 39): the mean over the seeds of fsdp's final eval loss minus ddp's within
0.02 nats, and with ``comm_hook.name=int8`` under fsdp within 0.03.

Projects, each trained as a user does (``ddpx train config.yaml`` in its folder):

* ``char_gpt``: ``examples/char_gpt`` as it ships (pre-norm GPT, context 64, 4 blocks,
  tied head, model computes its own loss, dict batches, AdamW, warm-up + cosine, bf16
  AMP, accumulation 2, 600 optimizer steps);
* ``own_lm``: a user's own project, written by this script into ``--workdir``: a
  post-norm transformer (3 blocks, 96 wide, ReLU MLP, untied head, context 32) over
  the same sonnets as ``(inputs, targets)`` tuples, its own loss module, AdamW with
  torch's cosine schedule, bf16 AMP, no accumulation, 400 steps.

Strategies: ``ddp`` (DDP's own all-reduce, ``comm_hook.name=allreduce``; the example's
powersgd is switched off so the baseline is uncompressed), ``fsdp``, ``fsdp_int8``
(``trainer.strategy=fsdp comm_hook.name=int8``).

Each cell is one ``ddpx train`` process group; its run directory under ``--workdir``
keeps ``cell.json`` (the command and result) and a later call with the same workdir
and the same command reads it back instead of training again (add strategies or
seeds without rerunning the rest).

    python benchmarks/bench_convergence_sharded.py                       # everything, full length
    python benchmarks/bench_convergence_sharded.py --projects own_lm --strategies ddp,fsdp --seeds 3
    python benchmarks/bench_convergence_sharded.py --steps char_gpt=200 --out sharded.json

``--steps PROJECT=N`` shortens a project's run (its schedule scaled to match); the
table says the steps each row ran.

``--gradient-precision`` (one process, seconds) shows where fsdp's bf16 AMP computes
differently from ddp's: the example's gradients on one batch of 32 windows, each
parameter group's error against fp32, with fp32 parameters under ``torch.autocast``
(ddp's AMP) and with the parameters themselves in bf16 under autocast (fsdp's AMP,
``MixedPrecisionPolicy(param_dtype=bf16)``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchjson import emit

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHAR_GPT = os.path.join(ROOT, "examples", "char_gpt")
STRATEGIES = {  # name: overrides
    "ddp": ["trainer.strategy=ddp", "comm_hook.name=allreduce", "comm_hook.options={}"],
    "fsdp": ["trainer.strategy=fsdp", "comm_hook.name=allreduce", "comm_hook.options={}"],
    "fsdp_int8": ["trainer.strategy=fsdp", "comm_hook.name=int8", "comm_hook.options={}"],
}
TARGETS = {"fsdp": 0.02, "fsdp_int8": 0.03}  # nats, |mean(strategy - ddp)| over the seeds

# --- the user's own project (written into the workdir) -------------------------------------

OWN_MODEL = '''"""A post-norm transformer language model over characters: logits out, the loss outside."""
import torch
import torch.nn.functional as F
from torch import nn


class PostNormBlock(nn.Module):
    def __init__(self, width, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm1 = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
        self.norm2 = nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = self.norm1(x + self.drop(self.out(a.transpose(1, 2).reshape(b, t, c))))
        return self.norm2(x + self.drop(self.ff(x)))


class CharLM(nn.Module):
    def __init__(self, vocab=128, context=32, width=96, heads=4, layers=3, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        nn.init.normal_(self.position, std=0.02)
        self.layers = nn.ModuleList(PostNormBlock(width, heads, dropout) for _ in range(layers))
        self.unembed = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.unembed(x)


class SequenceLoss(nn.Module):
    """Mean cross-entropy over every position of (batch, time, vocab) logits."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
'''

OWN_DATA = '''"""Character windows of a text as (inputs, targets) tuples: training windows at every
offset of the first 90 %, validation windows side by side over the rest."""
import torch
from torch.utils.data import Dataset


class Windows(Dataset):
    def __init__(self, ids, context, stride):
        self.ids, self.context, self.stride = ids, context, stride

    def __len__(self):
        return (len(self.ids) - self.context - 1) // self.stride + 1

    def __getitem__(self, i):
        chunk = self.ids[i * self.stride:i * self.stride + self.context + 1]
        return chunk[:-1], chunk[1:]


def load(path, context=32):
    with open(path, encoding="utf-8") as f:
        ids = torch.tensor([min(ord(c), 127) for c in f.read()], dtype=torch.long)
    cut = int(len(ids) * 0.9)
    return Windows(ids[:cut], context, 1), Windows(ids[cut:], context, context)
'''

OWN_CONFIG = {
    "seed": 0,
    "model": {"target": "lm.CharLM", "args": {"context": 32, "width": 96, "heads": 4, "layers": 3}},
    "data": {"target": "corpus.load", "args": {"path": os.path.join(CHAR_GPT, "sonnets.txt"), "context": 32}},
    "loss": {"target": "lm.SequenceLoss"},
    "optimizer": {"target": "torch.optim.AdamW", "args": {"lr": 0.001, "weight_decay": 0.05}},
    "scheduler": {"target": "torch.optim.lr_scheduler.CosineAnnealingLR", "args": {"T_max": 400}},
    "trainer": {"epochs": 100, "max_steps": 400, "batch_size": 32, "eval_batch_size": 64, "grad_clip": 1.0},
    "amp": {"enabled": True, "dtype": "bf16"},
}


def write_own_project(folder: str) -> str:
    """The user's project folder (model, data, config.yaml); returns the config's path."""
    import yaml

    os.makedirs(folder, exist_ok=True)
    for name, text in (("lm.py", OWN_MODEL), ("corpus.py", OWN_DATA)):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    path = os.path.join(folder, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(OWN_CONFIG, f, sort_keys=False)
    return path


# --- the projects ---------------------------------------------------------------------------


def char_gpt_steps(steps: int) -> list[str]:
    """The example shortened to ``steps``: its 50 warm-up steps of 600 scaled alike."""
    return [f"trainer.max_steps={steps}", f"scheduler.args.total_steps={steps}",
            f"scheduler.args.warmup_steps={max(1, round(50 * steps / 600))}"]


PROJECTS = {  # name: (full steps, overrides for a length)
    "char_gpt": (600, char_gpt_steps),
    "own_lm": (400, lambda steps: [f"trainer.max_steps={steps}", f"scheduler.args.T_max={steps}"]),
}


def project_config(project: str, workdir: str) -> str:
    if project == "char_gpt":
        return os.path.join(CHAR_GPT, "config.yaml")
    return write_own_project(os.path.join(workdir, project))


def final_eval_loss(metrics_file: str) -> tuple[float, int]:
    """(eval_loss, step) of the last evaluation in a run's metrics.jsonl."""
    last = None
    with open(metrics_file) as f:
        for line in f:
            record = json.loads(line)
            if "eval_loss" in record:
                last = record
    if last is None:
        raise SystemExit(f"{metrics_file} has no eval_loss record")
    return last["eval_loss"], last["step"]


def run_cell(project: str, strategy: str, seed: int, steps: int, workdir: str, timeout: float) -> dict:
    """One ``ddpx train`` on 2 gloo ranks, or its result read back from an earlier call."""
    config = project_config(project, workdir)
    run_dir = os.path.join(workdir, f"{project}-{steps}-{strategy}-s{seed}")
    cmd = ["ddpx", "train", "config.yaml", "--nproc-per-node", "2", f"seed={seed}", *STRATEGIES[strategy],
           *PROJECTS[project][1](steps), "logging.progress=false", "checkpoint.enabled=false"]
    record = os.path.join(run_dir, "cell.json")
    if os.path.exists(record):
        with open(record) as f:
            done = json.load(f)
        if done["command"] == cmd:
            return done
    full = [sys.executable, "-m", "ddpx", *cmd[1:], f"run_dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.run(full, cwd=os.path.dirname(config), capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise SystemExit(f"{project} {strategy} seed {seed}: `{' '.join(cmd)}` exited {proc.returncode}:\n"
                         + "\n".join(tail))
    loss, step = final_eval_loss(os.path.join(run_dir, "metrics.jsonl"))
    if step != steps:
        raise SystemExit(f"{project} {strategy} seed {seed}: last evaluation at step {step}, not {steps}")
    done = {"command": cmd, "eval_loss": loss, "seconds": seconds}
    with open(record, "w") as f:
        json.dump(done, f, indent=1)
    return done


def run_table(projects, strategies, seeds, steps: dict, workdir: str, timeout: float, log=print) -> list[dict]:
    """One row per project: each strategy's final eval loss per seed and its mean difference to ddp."""
    rows = []
    for project in projects:
        n = steps.get(project, PROJECTS[project][0])
        row = {"project": project, "steps": n, "full_steps": PROJECTS[project][0], "seeds": list(seeds),
               "strategies": {}}
        for strategy in ("ddp", *[s for s in strategies if s != "ddp"]):
            cells = []
            for seed in seeds:
                cells.append(run_cell(project, strategy, seed, n, workdir, timeout))
                log(f"{project} ({n} steps) {strategy} seed {seed}: eval_loss {cells[-1]['eval_loss']:.4f} "
                    f"({cells[-1]['seconds']:.0f} s)")
            losses = [c["eval_loss"] for c in cells]
            entry = {"eval_loss": losses, "mean": statistics.fmean(losses),
                     "seconds": statistics.fmean(c["seconds"] for c in cells)}
            if strategy != "ddp":
                deltas = [a - b for a, b in zip(losses, row["strategies"]["ddp"]["eval_loss"])]
                entry.update(deltas=deltas, delta=statistics.fmean(deltas), target=TARGETS[strategy],
                             meets_target=abs(statistics.fmean(deltas)) <= TARGETS[strategy])
            row["strategies"][strategy] = entry
        rows.append(row)
    return rows


def table(rows) -> str:
    lines = []
    for row in rows:
        names = list(row["strategies"])
        lines += [f"{row['project']}, {row['steps']} optimizer steps (full: {row['full_steps']}), final eval loss (nats):",
                  "", "| seed | " + " | ".join(names) + " | " + " | ".join(f"{s} - ddp" for s in names[1:]) + " |",
                  "|" + "---|" * (1 + 2 * len(names) - 1)]
        for i, seed in enumerate(row["seeds"]):
            cells = [f"{row['strategies'][s]['eval_loss'][i]:.4f}" for s in names]
            cells += [f"{row['strategies'][s]['deltas'][i]:+.4f}" for s in names[1:]]
            lines.append(f"| {seed} | " + " | ".join(cells) + " |")
        cells = [f"{row['strategies'][s]['mean']:.4f}" for s in names]
        cells += [f"**{row['strategies'][s]['delta']:+.4f}**" for s in names[1:]]
        lines.append("| mean | " + " | ".join(cells) + " |")
        verdicts = [f"{s} {'meets' if e['meets_target'] else 'MISSES'} {e['target']}"
                    for s, e in row["strategies"].items() if s != "ddp"]
        seconds = ", ".join(f"{s} {e['seconds']:.0f}" for s, e in row["strategies"].items())
        lines += ["", f"target |mean difference|: {'; '.join(verdicts)}; seconds per run: {seconds}", ""]
    return "\n".join(lines)


def gradient_precision() -> dict:
    """{parameter group: (autocast error, bf16-parameter error)}: the relative error of the
    char GPT's gradient norm per group against fp32, one batch, dropout off."""
    import copy

    import torch

    if CHAR_GPT not in sys.path:
        sys.path.insert(0, CHAR_GPT)
    import gpt
    import text

    torch.manual_seed(0)
    train, _ = text.splits()
    model = gpt.GPT(dropout=0.0)
    rows = [train[i] for i in torch.randint(len(train), (32,), generator=torch.Generator().manual_seed(1)).tolist()]
    idx, targets = (torch.stack([r[k] for r in rows]) for k in ("idx", "targets"))

    def grads(m, autocast):
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            m(idx, targets).backward()
        return {name: p.grad.float() for name, p in m.named_parameters()}

    exact, autocast, bf16 = grads(model, False), grads(model, True), grads(copy.deepcopy(model).bfloat16(), True)
    groups = {"LayerNorm weights and biases": lambda n: ".ln" in n or n.startswith("ln."),
              "embeddings (token, tied head; position)": lambda n: n.startswith(("tok.", "pos.")),
              "Linear weights and biases": lambda n: not (".ln" in n or n.startswith(("ln.", "tok.", "pos.")))}

    def error(got, names):
        diff = sum(float((got[n] - exact[n]).pow(2).sum()) for n in names)
        return (diff / sum(float(exact[n].pow(2).sum()) for n in names)) ** 0.5

    return {group: (error(autocast, [n for n in exact if test(n)]), error(bf16, [n for n in exact if test(n)]))
            for group, test in groups.items()}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--projects", default=",".join(PROJECTS))
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"of {', '.join(STRATEGIES)}; ddp always runs")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1")
    p.add_argument("--steps", action="append", default=[], metavar="PROJECT=N",
                   help="shorten a project's run to N optimizer steps (default: its full length)")
    p.add_argument("--workdir", default=None, help="the run directories (default: a new temporary folder); "
                   "cells already run there with the same command are read back")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--gradient-precision", action="store_true",
                   help="only compare the example's gradients under ddp's and fsdp's bf16 AMP (one process)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line (no table)")
    p.add_argument("--out", default=None, help="also write the result as JSON to this file")
    args = p.parse_args(argv)
    args.projects = [x for x in args.projects.split(",") if x]
    args.strategies = [x for x in args.strategies.split(",") if x]
    for value, known, flag in ((args.projects, PROJECTS, "--projects"), (args.strategies, STRATEGIES, "--strategies")):
        for name in value:
            if name not in known:
                p.error(f"{flag}: unknown {name!r}; known: {', '.join(known)}")
    steps = {}
    for item in args.steps:
        project, _, n = item.partition("=")
        if project not in PROJECTS or not n.isdigit() or int(n) < 1:
            p.error(f"--steps takes PROJECT=N with PROJECT one of {', '.join(PROJECTS)}, got {item!r}")
        steps[project] = int(n)
    args.steps = steps
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.gradient_precision:
        errors = gradient_precision()
        report = {"gradient_relative_error": {g: {"autocast": a, "bf16_params": b} for g, (a, b) in errors.items()}}
        if not emit(report, args.out, args.json):
            print("| parameters | ddp: fp32 parameters, autocast | fsdp: bf16 parameters, autocast |\n|---|---|---|")
            for group, (a, b) in errors.items():
                print(f"| {group} | {a:.4f} | {b:.4f} |")
        return 0
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="bench_convergence_sharded-"))
    os.makedirs(workdir, exist_ok=True)
    log = (lambda line: print(line, file=sys.stderr, flush=True))
    rows = run_table(args.projects, args.strategies, range(args.seeds), args.steps, workdir, args.timeout, log)
    report = {"targets": TARGETS, "world_size": 2, "backend": "gloo", "workdir": workdir, "rows": rows}
    if not emit(report, args.out, args.json):
        print(table(rows))
    return 0 if all(e.get("meets_target", True) for r in rows for e in r["strategies"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
