"""trainer.strategy: pipeline (ddpx/strategies/pipeline.py): the char GPT example cut into stages
trains as ddp does on the same global batch (1f1b with accumulation, gpipe, interleaved_1f1b;
2 stages x 2 replicas with int8 on the data-parallel group), its checkpoints resume exactly and
at another layout, ``ddpx export`` reads them, a user's own transformer pipelines too, and what
the strategy refuses is one line with exit code 2 before anything trains."""

import json
import re
import shutil
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.strategies import pipeline, stages

ROOT = Path(__file__).resolve().parent.parent  # not harness's: ranks import this module (model.target)
EXAMPLE = ROOT / "examples" / "char_gpt"
# the char GPT made small; fp32, no dropout: the pipeline's numbers are ddp's up to rounding
SMALL = ["model.args.n_layer=4", "model.args.n_embd=64", "model.args.block_size=32", "data.args.block_size=32",
         "model.args.dropout=0.0", "amp.enabled=false", "comm_hook.name=allreduce", "trainer.batch_size=8",
         "accumulation.steps=2", "trainer.eval_batch_size=40", "logging.progress=false", "checkpoint.enabled=false",
         "ema.decay=0.8", "logging.every_steps=1"]  # the example's grad_clip 1.0 clips every step (norms ~2-4)
STEPS = 6
TOLERANCE = 1e-5  # runs differ by about 2e-7; a wrong gradient, a skipped layer or a lost micro-batch by far more


def train(ranks, run_dir, *overrides, nproc=2, config=EXAMPLE / "config.yaml", timeout=150):
    """``ddpx train`` of the small char GPT: :func:`finished`."""
    rc, out, err = ranks.cli(["train", str(config), *SMALL, f"trainer.max_steps={STEPS}", *overrides,
                              f"launch.nproc_per_node={nproc}", f"run_dir={run_dir}"], timeout=timeout)
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    return finished(run_dir)


def finished(run_dir):
    """``(metrics.jsonl's lines, console.log, model/model.safetensors's tensors, run_dir)``."""
    from safetensors.torch import load_file

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return lines, (run_dir / "console.log").read_text(), load_file(run_dir / "model" / "model.safetensors"), run_dir


def evaluated(lines):
    return [line for line in lines if "eval_loss" in line]


def largest_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_same_end(lines, weights, reference, tolerance):
    """The eval loss, the EMA's eval loss and the weights of ``reference``'s end."""
    end, ref_end = evaluated(lines)[-1], evaluated(reference[0])[-1]
    assert end["step"] == ref_end["step"] == STEPS
    for key in ("eval_loss", "ema_eval_loss"):
        assert abs(end[key] - ref_end[key]) < tolerance, (key, end[key], ref_end[key])
    assert largest_difference(weights, reference[2]) < tolerance


def assert_trains_as(run, reference, tolerance=TOLERANCE):
    """The same eval loss, EMA eval loss, weights and (clipped: the norm over every stage) gradient norms."""
    (lines, _, weights, _), (ref_lines, _, ref_weights, _) = run, reference
    epochs, ref_epochs = evaluated(lines), evaluated(ref_lines)
    assert [e["step"] for e in epochs] == [e["step"] for e in ref_epochs] == [STEPS]
    for key in ("eval_loss", "ema_eval_loss"):
        assert abs(epochs[-1][key] - ref_epochs[-1][key]) < tolerance, key
    assert largest_difference(weights, ref_weights) < tolerance
    norms = [[line["grad_norm"] for line in run if "grad_norm" in line] for run in (lines, ref_lines)]
    assert len(norms[1]) == STEPS and min(norms[1]) > 1.0  # clipped at every step
    assert all(abs(a - b) < tolerance * b for a, b in zip(*norms)) and len(norms[0]) == STEPS, norms


@pytest.fixture(scope="module")
def ddp_reference(ranks, tmp_path_factory):
    """ddp on 1 rank: the global batch of a 2-stage pipeline with 1 replica."""
    return train(ranks, tmp_path_factory.mktemp("ddp") / "run", "trainer.strategy=ddp", nproc=1)


@pytest.fixture(scope="module")
def one_f_one_b(ranks, tmp_path_factory):
    return train(ranks, tmp_path_factory.mktemp("1f1b") / "run", "trainer.strategy=pipeline")


def gpt(**args):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import gpt as module
    finally:
        sys.path.remove(str(EXAMPLE))
    return module.GPT(**{"n_layer": 4, "n_embd": 64, "block_size": 32, "dropout": 0.0, **args})


@pytest.mark.slow
def test_two_stages_train_as_ddp_on_one_rank(one_f_one_b, ddp_reference):
    """1f1b, 2 accumulation steps of 4 micro-batches each: ddp's numbers (:func:`assert_trains_as`);
    model/model.safetensors holds the user's model, every key (the tied head through the tie)."""
    from safetensors.torch import load_model

    assert_trains_as(one_f_one_b, ddp_reference)
    epochs, console, weights, _ = one_f_one_b
    assert "[rank0] pipeline: 2 stages over 2 ranks x 1 replica, 1f1b with 4 micro-batches; this rank: stage 0 " \
           "(blocks.0..blocks.1, 99968 block parameters)" in console
    assert evaluated(epochs)[-1]["eval_loss"] < 4.7  # it learned (4.85 = log(128) at the start)
    model = gpt()
    load_model(model, one_f_one_b[3] / "model" / "model.safetensors")  # strict; tok.weight written once, tied
    assert model.head.weight is model.tok.weight
    model.load_state_dict({**weights, "head.weight": weights["tok.weight"]}, strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
def test_gpipe_and_interleaved_train_as_ddp(ranks, ddp_reference, tmp_path, schedule):
    """gpipe, and interleaved_1f1b with 2 stages per rank (4 stages of one block each, rank 0
    holding stages 0 and 2): ddp's numbers. gpipe's with the example's powersgd, which a pipeline
    without replicas has no gradients for: one line says so."""
    interleaved = schedule == "interleaved_1f1b"
    extra = ["pipeline.stages_per_rank=2"] if interleaved else ["comm_hook.name=powersgd"]
    run = train(ranks, tmp_path / "run", "trainer.strategy=pipeline", f"pipeline.schedule={schedule}", *extra)
    assert_trains_as(run, ddp_reference)
    line = ("4 stages over 2 ranks x 1 replica, interleaved_1f1b with 4 micro-batches; this rank: stages 0, 2 "
            "(blocks.0..blocks.2, 99968 block parameters)") if interleaved else \
        "2 stages over 2 ranks x 1 replica, gpipe with 4 micro-batches"
    assert f"[rank0] pipeline: {line}" in run[1]
    ignored = [line for line in run[1].splitlines() if "ignored" in line]
    assert ignored == ([] if interleaved else [
        "[rank0] comm_hook.name=powersgd ignored: the pipeline's stages have one replica each, so no gradients are "
        "averaged over data-parallel ranks; start 4, 6, ... ranks (replicas of each stage) to compress theirs, or set "
        "comm_hook.name=allreduce"])


@pytest.mark.slow
def test_two_replicas_of_two_stages_compress_their_gradients_with_int8(ranks, ddp_reference, tmp_path):
    """4 ranks: 2 pipelines of 2 stages, each stage's 2 replicas one DDP group whose comm hook is int8; at 4
    samples per replica, ddp's global batch on 1 rank: its numbers within int8's error, at ~3.6x fewer bytes."""
    epochs, console, weights, _ = train(ranks, tmp_path / "run", "trainer.strategy=pipeline", "comm_hook.name=int8",
                                        "comm_hook.options={}", "trainer.batch_size=4", nproc=4, timeout=240)
    assert "[rank0] pipeline: 2 stages over 2 ranks x 2 replicas, 1f1b with 4 micro-batches" in console
    # installed on the stage's DDP (rank 0: blocks 0-1 and the trunk, 28 of the model's 52 tensors)
    assert "[rank0] comm hook int8 installed (native C++ hook, DDP buckets of 4 MB, gradients as bucket views); " \
           "10 of 28 parameters compressed" in console
    assert re.search(r"comm \d+ kB/step, 3\.\d\dx less than fp32 allreduce", console), console
    assert_same_end(epochs, weights, ddp_reference, 0.01)


@pytest.fixture(scope="module")
def halfway(ranks, tmp_path_factory):
    """A pipeline run to half the steps, with its checkpoint (step 3), copied away before anything resumes it."""
    run_dir = tmp_path_factory.mktemp("halfway") / "run"
    train(ranks, run_dir, "trainer.strategy=pipeline", "checkpoint.enabled=true", f"trainer.max_steps={STEPS // 2}")
    return run_dir


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_exactly(ranks, halfway, one_f_one_b, tmp_path):
    """Stopped at step 3 (each stage wrote its blocks and the trunk into the shard directory, keyed by the
    user's names), resumed to 6: the weights of the run that was not interrupted, and its eval loss."""
    checkpoints = halfway / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == [
        "step-000000003.pt", "step-000000003.shards"]
    assert sorted(p.name for p in (checkpoints / "step-000000003.shards").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    run_dir = tmp_path / "run"
    shutil.copytree(halfway, run_dir)
    epochs, console, weights, _ = train(ranks, run_dir, "trainer.strategy=pipeline", "checkpoint.enabled=true")
    assert f"resumed from {run_dir / 'checkpoints' / 'step-000000003.pt'} (epoch 0, step 3)" in console
    assert_same_end(epochs, weights, one_f_one_b, 1e-6)  # the EMA's average resumed too


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_on_two_replicas_and_exports(ranks, halfway, one_f_one_b, tmp_path):
    """``ddpx export`` reads the shard directory in one process into the whole model: the weights the halfway
    run wrote at its end, loadable into the user's GPT. The 2-rank checkpoint resumed by 4 ranks (2 replicas
    of 2 stages, each reading its stage's names) at half the batch per replica, the same global batch:
    the uninterrupted run's numbers."""
    from safetensors.torch import load_file, load_model

    from ddpx.cli import main

    out = tmp_path / "export"
    assert main(["export", str(halfway), "--out", str(out)]) == 0
    exported = load_file(out / "model.safetensors")
    assert largest_difference(exported, load_file(halfway / "model" / "model.safetensors")) == 0
    model = gpt()
    load_model(model, out / "model.safetensors")  # strict; the tied head through the tie
    assert model.head.weight is model.tok.weight

    run_dir = tmp_path / "run"
    shutil.copytree(halfway, run_dir)
    epochs, console, weights, _ = train(ranks, run_dir, "trainer.strategy=pipeline", "checkpoint.enabled=true",
                                        "trainer.batch_size=4", nproc=4, timeout=240)
    assert "pipeline: 2 stages over 2 ranks x 2 replicas" in console
    assert f"resumed from {run_dir / 'checkpoints' / 'step-000000003.pt'} (epoch 0, step 3)" in console
    assert "resuming with 2 data-parallel replicas (4 ranks) from a checkpoint of 1 (2 ranks): the rest of epoch 0 is " \
           "re-divided, the global batch is now 2 replicas x 4 x 2 accumulation steps = 16 samples, RNG states are " \
           "seeded from (seed, replica, step)" in console
    assert_same_end(epochs, weights, one_f_one_b, TOLERANCE)  # the EMA's too, each stage's read by name


# --- refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["pipeline.stages=1"], "pipeline.stages=1: a pipeline needs at least 2 stages; with 1 every rank holds the whole "
                            "model: set trainer.strategy=ddp"),
    (["pipeline.microbatches=3"], "trainer.batch_size=8 does not split into pipeline.microbatches=3 equal "
                                  "micro-batches; set trainer.batch_size to a multiple of 3, or pipeline.microbatches "
                                  "to a divisor of 8"),
    (["pipeline.stages_per_rank=2"], "pipeline.stages_per_rank=2 needs pipeline.schedule=interleaved_1f1b (now 1f1b); "
                                     "or set pipeline.stages_per_rank=1"),
    (["pipeline.schedule=interleaved_1f1b"], "pipeline.schedule=interleaved_1f1b gives each rank several stages: set "
                                             "pipeline.stages_per_rank=2 (or more), or pipeline.schedule=1f1b"),
    (["trainer.compile=true"], "trainer.compile does not apply under trainer.strategy=pipeline (the stages run the "
                               "model piece by piece); set trainer.compile=false"),
    (["pipeline.schedule=interleaved_1f1b", "pipeline.stages_per_rank=2", "comm_hook.name=powersgd"],
     "comm_hook.name=powersgd does not apply with pipeline.stages_per_rank=2: an interleaved pipeline runs without "
     "data-parallel replicas here, so there is nothing to compress; set comm_hook.name=allreduce, or "
     "pipeline.stages_per_rank=1 (schedule 1f1b or gpipe)"),  # the char GPT example's comm hook
])
def test_what_the_pipeline_config_refuses_is_one_line(overrides, message):
    with pytest.raises(DdpxError) as refused:
        load_config(None, ["trainer.strategy=pipeline", "trainer.batch_size=8", *overrides])
    assert str(refused.value) == message


class Flat(nn.Module):
    """No container of repeated blocks: nothing to cut."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.head = nn.Linear(4, 8), nn.LayerNorm(8), nn.Sequential(nn.Linear(8, 2), nn.ReLU())


def test_what_the_pipeline_refuses_of_a_model_is_one_line():
    with pytest.raises(DdpxError, match=r"^pipeline.stages x pipeline.stages_per_rank = 4 stages, but GPT has 2 "
                                        r"blocks in blocks to cut; use at most 2 stages$"):
        stages.stage_ranges(gpt(n_layer=2), 4, "auto")
    with pytest.raises(DdpxError, match=r"^trainer.strategy=pipeline cuts a model's repeated blocks .* but Flat has no "
                                        r"container of repeated blocks; its modules: embed, norm, head; "):
        stages.stage_ranges(Flat(), 2, "auto")
    with pytest.raises(DdpxError, match=r"^pipeline.split names ln, which is not a block of GPT; stages begin at "
                                        r"blocks: blocks.0, blocks.1, blocks.2, blocks.3$"):
        stages.stage_ranges(gpt(), 2, ["ln"])
    with pytest.raises(DdpxError, match=r"^pipeline.split names 2 blocks, but 2 stages need 1 distinct blocks"):
        stages.stage_ranges(gpt(), 2, ["blocks.1", "blocks.2"])
    with pytest.raises(DdpxError, match=r"^pipeline.stages=3 does not divide the 2 ranks into groups of 3; set "
                                        r"pipeline.stages to one of 1, 2, or start a multiple of 3 ranks"):
        pipeline.model_parallel_mesh(types.SimpleNamespace(world_size=2), 3, "pp", "pipeline.stages")
    # what it cuts: balanced by parameters, a named split, an activation between blocks goes with the block before
    assert stages.stage_ranges(gpt(), 2, "auto")[3] == [(0, 2), (2, 4)]
    assert stages.stage_ranges(gpt(), 2, ["blocks.1"])[3] == [(0, 1), (1, 4)]
    digits = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    assert stages.stage_ranges(digits, 2, "auto")[3] == [(0, 2), (2, 5)]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, line", [
    (["pipeline.stages=1"], "pipeline.stages=1: a pipeline needs at least 2 stages; with 1 every rank holds the whole "
                            "model: set trainer.strategy=ddp"),  # the launcher's config check, before any rank starts
    (["pipeline.stages=3"], "[rank?] pipeline.stages=3 does not divide the 2 ranks into groups of 3; set "
                            "pipeline.stages to one of 1, 2, or start a multiple of 3 ranks (launch.nproc_per_node x "
                            "launch.nnodes)"),
])  # the second at wrap (the mesh), raised on every rank: the first rank's line, as the model's refusals at wrap
def test_a_refused_pipeline_is_one_line_exit_2_and_trains_nothing(ranks, tmp_path, overrides, line):
    run_dir = tmp_path / "run"
    rc, out, err = ranks.cli(["train", str(EXAMPLE / "config.yaml"), *SMALL, "trainer.strategy=pipeline", *overrides,
                              "launch.nproc_per_node=2", f"run_dir={run_dir}"], timeout=90)
    assert rc == 2, f"{out[-3000:]}\n{err[-3000:]}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(re.escape(f"ddpx: error: {line}").replace(r"\?", "[01]"), lines[0]), err
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "model").exists()


# --- a user's own transformer -----------------------------------------------------------------

PROJECT = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, h):
        x = self.norm1(h)
        h = h + self.attention(x, x, x, need_weights=False)[0]
        return h + self.mlp(self.norm2(h))


class Classifier(nn.Module):
    """Which of 4 classes a sequence of tokens is: the class of its most frequent token, mod 4."""

    def __init__(self, vocab=16, width=32, heads=2, layers=3, length=8):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Parameter(torch.zeros(length, width))
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, 4)

    def forward(self, tokens):
        h = self.embed(tokens) + self.position
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h).mean(dim=1))


class Loss(nn.Module):
    def __init__(self, smoothing=0.0):
        super().__init__()
        self.smoothing = smoothing

    def forward(self, logits, labels):
        return nn.functional.cross_entropy(logits, labels, label_smoothing=self.smoothing)


def data(n=330, vocab=16, length=8):
    x = torch.randint(vocab, (n, length), generator=torch.Generator().manual_seed(0))
    y = torch.mode(x, dim=1).values % 4
    both = torch.utils.data.TensorDataset(x, y)  # (tokens, labels) tuples
    return torch.utils.data.Subset(both, range(256)), torch.utils.data.Subset(both, range(256, n))
'''

PROJECT_CONFIG = '''
seed: 1
model: {target: tinyformer.Classifier, args: {}}
data: {target: tinyformer.data}
loss: {target: tinyformer.Loss, args: {smoothing: 0.05}}
optimizer: {target: torch.optim.AdamW, args: {lr: 0.003, weight_decay: 0.01}}
trainer: {epochs: 2, batch_size: 16, eval_batch_size: 32}
accumulation: {steps: 1}
pipeline: {microbatches: 2}
logging: {progress: false}
checkpoint: {enabled: false}
'''


@pytest.mark.slow
def test_a_users_own_transformer_pipelines_as_ddp(ranks, tmp_path):
    """A project's model (its own Block in a ModuleList, attention through nn.MultiheadAttention), its own
    loss on (inputs, labels) batches, AdamW: 2 stages of 2 micro-batches give ddp's losses, accuracy and
    weights on 1 rank over 2 epochs of 16 steps (each evaluation ends on a tail batch of 10 rows; the comm
    monitor's measurement at step 30 takes its allreduce on both stages)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "tinyformer.py").write_text(textwrap.dedent(PROJECT))
    (project / "cfg.yaml").write_text(textwrap.dedent(PROJECT_CONFIG))
    runs = {}
    for strategy, nproc in (("ddp", 1), ("pipeline", 2)):
        run_dir = tmp_path / strategy
        rc, out, err = ranks.cli(["train", str(project / "cfg.yaml"), f"trainer.strategy={strategy}",
                                  f"launch.nproc_per_node={nproc}", f"run_dir={run_dir}"], timeout=150)
        assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
        runs[strategy] = finished(run_dir)
    (ddp, _, ddp_weights, _), (piped, console, weights, _) = runs["ddp"], runs["pipeline"]
    assert "pipeline: 2 stages over 2 ranks x 1 replica, 1f1b with 2 micro-batches; this rank: stage 0 " \
           "(layers.0..layers.1" in console  # 3 equal blocks: 2 + 1
    assert [e["step"] for e in piped] == [e["step"] for e in ddp] == [16, 32]
    for key in ("loss", "eval_loss", "accuracy"):
        assert all(abs(a[key] - b[key]) < TOLERANCE for a, b in zip(piped, ddp)), key
    # but the attention's key bias: softmax ignores it, its gradient is rounding noise, which AdamW turns into
    # steps of about lr: another order of the sums (micro-batches) moves it by ~1e-3
    for weight in (weights, ddp_weights):
        for i in range(3):
            weight[f"layers.{i}.attention.in_proj_bias"][32:64] = 0
    assert largest_difference(weights, ddp_weights) < TOLERANCE
    assert piped[-1]["eval_loss"] < piped[0]["eval_loss"]


# --- a model that is itself the container of its blocks ------------------------------------------

def sequential(hidden: int = 32) -> nn.Sequential:
    """The digits MLP as a bare Sequential of 4 Linear blocks with a ReLU after each of the first 3."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@pytest.mark.slow
def test_a_bare_sequential_pipelines_as_ddp(ranks, tmp_path):
    """The model is the container: each rank keeps its blocks in it (what it writes and saves are its own
    blocks, trained), 4 interleaved stages begin where pipeline.split names (numbers, a Sequential's names),
    and the ReLU after a stage's last block runs on that stage: ddp's numbers on the digits."""
    common = ["model.target=tests.test_pipeline.sequential", "trainer.max_steps=6", "trainer.batch_size=16",
              "logging.progress=false", "amp.enabled=false", "comm_hook.name=allreduce", "checkpoint.enabled=false"]
    runs = {}
    for strategy, nproc, extra in (("ddp", 1, []), ("pipeline", 2, ["pipeline.schedule=interleaved_1f1b",
                                                                      "pipeline.stages_per_rank=2",
                                                                      "pipeline.split=[2,4,6]"])):
        rc, out, err = ranks.cli(["train", *common, f"trainer.strategy={strategy}", *extra,
                                  f"launch.nproc_per_node={nproc}", f"run_dir={tmp_path / strategy}"], timeout=120)
        assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
        runs[strategy] = finished(tmp_path / strategy)
    (ddp, _, ddp_weights, _), (piped, console, weights, _) = runs["ddp"], runs["pipeline"]
    assert "pipeline: 4 stages over 2 ranks x 1 replica, interleaved_1f1b with 4 micro-batches; this rank: stages " \
           "0, 2 (0..5, " in console
    for key in ("eval_loss", "accuracy"):
        assert abs(evaluated(piped)[-1][key] - evaluated(ddp)[-1][key]) < TOLERANCE, key
    assert largest_difference(weights, ddp_weights) < TOLERANCE
