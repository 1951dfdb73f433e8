"""trainer.strategy: fsdp (ddpx/train/fsdp.py): units, refusals, safe shard reading, and on 2 gloo
ranks the same numbers as ddp (losses, accumulation, clipping with the global norm, padded
evaluation), checkpoints that resume exactly at 2 ranks and train on at 1."""

import json
import pickle

import pytest
import torch
import yaml
from torch import nn
from torch.torch_version import TorchVersion

from ddpx.config import load_config
from ddpx.strategies.fsdp import MIN_TORCH as FSDP_MIN_TORCH
from ddpx.errors import DdpxError
from ddpx.strategies import fsdp, shards

# trainer.strategy=fsdp is refused on torch < 2.8 (its FSDP2 summed the gradients over gloo ranks);
# test_fsdp_on_a_torch_whose_fsdp2_sums_the_gradients_is_refused holds that line on a newer torch.
pytestmark = pytest.mark.skipif(TorchVersion(torch.__version__) < FSDP_MIN_TORCH,
                                reason="trainer.strategy=fsdp needs torch >= 2.8")


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)


class Tiny(nn.Module):
    def __init__(self, width=32, layers=3):
        super().__init__()
        self.embed = nn.Linear(4, width)  # 160 parameters
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))  # 1056 each
        self.head = nn.Linear(width, 2)  # 66


def test_auto_units_are_the_large_children_and_the_blocks_of_a_list():
    units = fsdp.unit_modules(Tiny(), "auto", min_params=1000)
    assert [name for name, _ in units] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [name for name, _ in fsdp.unit_modules(Tiny(), "auto", min_params=100)] == \
        ["embed", "blocks.0", "blocks.1", "blocks.2"]


class TiedBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(self.norm(h))))


class TiedGPT(nn.Module):
    """nanoGPT's shape: the blocks in a ModuleDict's ModuleList (``transformer.h``), the output head
    tied to the input embedding; predicts a token from the last position of ``x``."""

    def __init__(self, vocab=32, width=16, layers=2):
        super().__init__()  # 512 parameters in the tied embedding, 1 104 in a block
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(vocab, width),
                                          "h": nn.ModuleList(TiedBlock(width) for _ in range(layers)),
                                          "ln_f": nn.LayerNorm(width)})
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, x):
        h = self.transformer.wte(x)
        for block in self.transformer.h:
            h = block(h)
        return self.lm_head(self.transformer.ln_f(h[:, -1]))


def tied_data(n=640, vocab=32, length=4):
    """Sequences of random tokens; the target is the token after the last one (mod ``vocab``)."""
    x = torch.randint(vocab, (n, length), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, (x[:, -1] + 1) % vocab)
    return torch.utils.data.Subset(data, range(512)), torch.utils.data.Subset(data, range(512, n))


class Body(nn.Module):  # two blocks that are not in a container
    def __init__(self, width):
        super().__init__()
        self.first, self.second, self.norm = TiedBlock(width), TiedBlock(width), nn.LayerNorm(width)


class Hinted(nn.Module):
    _no_split_modules = ["TiedBlock"]  # as a HuggingFace model names its blocks

    def __init__(self, width=16):
        super().__init__()
        self.body = Body(width)


def test_auto_units_keep_tied_weights_in_the_root_and_find_blocks_at_any_depth():
    units = fsdp.unit_modules(TiedGPT(), "auto", min_params=300)
    assert [name for name, _ in units] == ["transformer.h.0", "transformer.h.1"]
    assert units.tied == [("transformer.wte", ["lm_head.weight"]), ("lm_head", ["transformer.wte.weight"])]
    assert fsdp.units_line(units, "2 ranks", 300) == (
        "fsdp: 2 units (transformer.h.0, transformer.h.1) + the root sharded over 2 ranks; tied, kept in the root: "
        "transformer.wte (shares lm_head.weight), lm_head (shares transformer.wte.weight)")
    small = fsdp.unit_modules(TiedGPT(), "auto", min_params=100_000)  # the blocks are found, too small to be units
    assert list(small) == [] and [name for name, _ in small.blocks] == ["transformer.h.0", "transformer.h.1"]
    assert fsdp.units_line(small, "2 ranks", 100_000) == (
        "fsdp: the whole model is one unit (the root), sharded over 2 ranks, so every parameter is gathered at once; "
        "its 2 blocks (TiedBlock) hold up to 1104 parameters each, below fsdp.min_unit_params=100000; to gather one "
        "at a time: fsdp.units=[TiedBlock]")
    # _no_split_modules names the blocks where no container holds them; without it the body is one piece
    assert [name for name, _ in fsdp.unit_modules(Hinted(), "auto", min_params=300)] == ["body.first", "body.second"]
    Hinted._no_split_modules = None
    try:
        assert [name for name, _ in fsdp.unit_modules(Hinted(), "auto", min_params=300)] == ["body"]
    finally:
        Hinted._no_split_modules = ["TiedBlock"]
    none = fsdp.unit_modules(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8)), "auto", min_params=10 ** 6)
    assert fsdp.units_line(none, "1 ranks", 10 ** 6).endswith(
        "fsdp.units=auto found no repeated block; name your model's block class, e.g. fsdp.units=[Block]")


def test_a_unit_by_class_name_that_shares_a_parameter_outside_it_is_one_line():
    with pytest.raises(DdpxError, match=r"^fsdp.units names Embedding, but transformer.wte shares a parameter with "
                                        r"lm_head.weight outside it \(tied weights\), and FSDP shards a parameter in "
                                        r"one unit only; leave Embedding out of fsdp.units \(the root then holds it\), "
                                        r"or set fsdp.units=auto$"):
        fsdp.unit_modules(TiedGPT(), ["TiedBlock", "Embedding"], 1)


def test_tied_weights_stay_tied_under_fsdp_get_both_gradients_and_are_written_once(make_config, tmp_path):
    """In one process (world 1): the tied parameter, kept in the root, is one DTensor in both modules,
    its gradient the embedding's plus the head's (measured apart on an untied copy); the gathered
    model is written with the tied tensor once and loads into a fresh model, tied again."""
    import copy
    import logging
    import types

    import torch.distributed as dist
    from safetensors.torch import load_file, load_model

    from ddpx.rank.model_files import SAFETENSORS, write_model

    torch.manual_seed(0)
    model = TiedGPT()
    untied = copy.deepcopy(model)
    x, y = (t[:16] for t in tied_data()[0].dataset.tensors)
    config = make_config("trainer.strategy=fsdp", "fsdp.min_unit_params=300")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        trainer = types.SimpleNamespace(config=config, device=torch.device("cpu"), world_size=1,
                                        log=logging.getLogger("test_fsdp"))
        fsdp.shard_model(trainer, model)
        assert model.lm_head.weight is model.transformer.wte.weight and shards.is_shard(model.lm_head.weight)
        nn.functional.cross_entropy(model(x), y).backward()
        grad = model.lm_head.weight.grad.full_tensor()
        whole = fsdp.FSDPStrategy(config).full_state_dict(model)
        assert write_model(whole, tmp_path / "model", model) == ([SAFETENSORS], "")
    finally:
        dist.destroy_process_group()
    untied.lm_head.weight = nn.Parameter(untied.transformer.wte.weight.detach().clone())
    nn.functional.cross_entropy(untied(x), y).backward()
    embedding, head = untied.transformer.wte.weight.grad, untied.lm_head.weight.grad
    assert embedding.abs().sum() > 0 and head.abs().sum() > 0
    torch.testing.assert_close(grad, embedding + head)
    assert sorted(load_file(tmp_path / "model" / SAFETENSORS)) == sorted(k for k in whole if k != "lm_head.weight")
    fresh = TiedGPT()
    load_model(fresh, tmp_path / "model" / SAFETENSORS)  # strict: every key, the tied one through the tie
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in whole.items())


def test_units_by_class_name_and_a_name_the_model_lacks():
    assert [name for name, _ in fsdp.unit_modules(Tiny(), ["Block"], 1)] == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(DdpxError, match=r"fsdp.units names Blok, but no submodule of Tiny is of that class "
                                        r"\(its classes: Block, Linear, ModuleList\)"):
        fsdp.unit_modules(Tiny(), ["Blok"], 1)


@pytest.mark.parametrize("overrides, message", [
    (["fsdp.units=blocks"], "config key 'fsdp.units' must be auto or a list of module class names"),
    (["trainer.strategy=fsdp", "comm_hook.name=powersgd"], "comm_hook.name=powersgd does not "
                                                           "apply under trainer.strategy=fsdp"),
    (["trainer.strategy=zero"], "unknown trainer.strategy 'zero'; choose one of ddp, fsdp, pipeline, tensor, or give an import path"),
    (["fsdp.shard_size=nodes"], "config key 'fsdp.shard_size' must be all, node or a number of ranks >= 1"),
    (["fsdp.shard_size=0"], "config key 'fsdp.shard_size' must be all, node or a number of ranks >= 1"),
])
def test_what_fsdp_refuses_is_one_config_error(overrides, message):
    with pytest.raises(DdpxError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config(None, overrides)


def test_fsdp_on_a_torch_whose_fsdp2_sums_the_gradients_is_refused(monkeypatch):
    """compat.sh with torch 2.7.1: fsdp's gradients were 2x ddp's on 2 gloo ranks (the sum, not the mean)."""
    monkeypatch.setattr(torch, "__version__", "2.7.1+cpu")
    with pytest.raises(DdpxError, match=r"^trainer.strategy=fsdp needs torch >= 2.8 \(torch 2.7.1\+cpu's FSDP2 sums "
                                        r"the gradients over the ranks instead of averaging them\); upgrade torch, "
                                        r"or set trainer.strategy=ddp$"):
        load_config(None, ["trainer.strategy=fsdp"])
    load_config(None, ["trainer.strategy=ddp"])


def test_the_default_comm_hook_and_no_ema_pass_under_fsdp():
    config = load_config(None, ["trainer.strategy=fsdp", "fsdp.units=[Linear]", "fsdp.reduce_dtype=bf16"])
    assert config.trainer.strategy == "fsdp" and config.fsdp.units == ["Linear"]


class Boom:
    def __reduce__(self):
        import os

        return (os.system, ("echo ran > /dev/null",))


def test_shard_metadata_that_names_other_globals_is_refused_unrun(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Boom()))
    reader, _ = shards._reader_classes()
    with pytest.raises(DdpxError, match=r"refusing shard directory .*: its metadata needs posix.system, which a "
                                        r"ddpx shard directory never holds \(loading it could run code\)"):
        reader(str(tmp_path)).read_metadata()


# --- 2 gloo ranks ----------------------------------------------------------------------------

COMMON = {
    "model": {"target": "ddpx.models.DigitsMLP", "args": {"hidden": 16}},
    # 359 evaluation samples: rank 0 gets 180 (2 batches of 179), rank 1 179 (1): fsdp pads rank 1's forwards
    "trainer": {"batch_size": 64, "eval_batch_size": 179, "backend": "gloo", "device": "cpu"},
    "logging": {"progress": False, "every_steps": 4},
    "comm_monitor": {"enabled": False},
}


def train(ranks, run_dir, world=2, timeout=150, **sections):
    """Train on ``world`` ranks (ddpx.worker, no torchrun); return rank 0's metrics.jsonl lines."""
    config = {key: dict(value) for key, value in COMMON.items()}
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    config["run_dir"] = str(run_dir)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    ranks.train(run_dir, path, world, timeout)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def epochs(lines):
    return [line for line in lines if "eval_loss" in line]


def close(a, b, tol):
    return all(abs(x - y) <= tol * max(1.0, abs(x)) for x, y in zip(a, b)) and len(a) == len(b)


def digits_bn(hidden: int = 16) -> nn.Module:
    """The digits MLP with a BatchNorm layer (trainer.sync_batchnorm under fsdp)."""
    return nn.Sequential(nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 10))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, extra", [
    ({"target": "torch.optim.AdamW", "args": {"lr": 0.003}},
     {"compressed": [("fsdp", "int8")], "fsdp_trainer": {"compile": True}}),
    ({"target": "torch.optim.SGD", "args": {"lr": 0.05, "momentum": 0.9}},
     {"model": {"target": "tests.test_fsdp.digits_bn", "args": {}}, "trainer": {"sync_batchnorm": True}}),
])
def test_fsdp_trains_as_ddp_with_accumulation_and_clipping(ranks, tmp_path, optimizer, extra):
    """fp32: the same losses, evaluation and gradient norms as ddp, with 2 micro-batches per step
    and a clip that acts on every step; the norm is the global one (a rank's own shards would
    give about 1/sqrt(2) of it). AdamW's fsdp run is compiled (trainer.compile), SGD's runs have
    a synchronized BatchNorm. The EMA (of each rank's shards under fsdp; with the BatchNorm's
    buffers in SGD's run) evaluates and exports as ddp's. AdamW's also runs fsdp with int8's
    reduce-scatter: it trains as fsdp's fp32 one, within 0.1 % of its eval loss."""
    runs = {}
    for strategy, hook in (("ddp", "allreduce"), ("fsdp", "allreduce"), *extra.get("compressed", ())):
        fsdp_trainer = extra.get("fsdp_trainer", {}) if (strategy, hook) == ("fsdp", "allreduce") else {}
        runs[strategy if hook == "allreduce" else hook] = train(
            ranks, tmp_path / f"{strategy}-{hook}",
            trainer={"strategy": strategy, "epochs": 2, "grad_clip": 0.05, **extra.get("trainer", {}), **fsdp_trainer},
            model=extra.get("model", COMMON["model"]), optimizer=optimizer, comm_hook={"name": hook},
            accumulation={"steps": 2}, checkpoint={"enabled": False}, fsdp={"units": ["Linear"]},
            ema={"decay": 0.8, "buffers": "model" in extra})
    ddp, sharded = runs["ddp"], runs["fsdp"]
    assert len(epochs(ddp)) == 2
    for key in ("loss", "eval_loss", "accuracy", "ema_eval_loss", "ema_accuracy"):
        assert close([e[key] for e in epochs(sharded)], [e[key] for e in epochs(ddp)], 1e-5), key
    assert abs(epochs(ddp)[-1]["ema_eval_loss"] - epochs(ddp)[-1]["eval_loss"]) > 1e-3  # the EMA is not the raw model
    norms = {name: [line["grad_norm"] for line in run if "grad_norm" in line] for name, run in runs.items()}
    assert len(norms["ddp"]) >= 2 and min(norms["ddp"]) > 0.05  # clipping acted
    assert close(norms["fsdp"], norms["ddp"], 1e-4)
    if "int8" in runs:  # int8's reduce-scatter (ddpx/comm_hooks/reduce_scatter.py): trains as fp32's, not bit for bit
        compressed = epochs(runs["int8"])
        assert compressed[-1]["eval_loss"] < compressed[0]["eval_loss"]
        assert close([e["eval_loss"] for e in compressed], [e["eval_loss"] for e in epochs(sharded)], 1e-3)
        assert not close([e["loss"] for e in compressed], [e["loss"] for e in epochs(sharded)], 1e-7)
        # bytes per step against fp32's reduce-scatter, from the comm's stats(): block_size auto is 64
        # (1 + 4/64 of 4 bytes) from the first step, the comm being paired with AdamW at train start
        ratios = [line["comm_compression"] for line in runs["int8"] if line["kind"] == "step"]
        assert all(3.5 < r < 4.0 for r in ratios) and ratios[-1] < 3.8, ratios
    exported = {name: torch.load(tmp_path / f"{name}-allreduce" / "ema_weights.pt", weights_only=True)
                for name in ("ddp", "fsdp")}
    # the model each strategy wrote at the end (ddp's from rank 0, fsdp's gathered) loads strictly; the same weights
    from safetensors.torch import load_file

    from ddpx.models import DigitsMLP

    model = digits_bn() if "model" in extra else DigitsMLP(hidden=16)
    written = {name: load_file(tmp_path / f"{name}-allreduce" / "model" / "model.safetensors")
               for name in ("ddp", "fsdp")}
    for weights in written.values():
        model.load_state_dict(weights)
    assert all(close(written["fsdp"][k].flatten().tolist(), v.flatten().tolist(), 1e-4)
               for k, v in written["ddp"].items())


@pytest.mark.slow
def test_fsdp_checkpoints_resume_exactly_at_2_ranks_and_train_on_at_1(ranks, tmp_path):
    """Each rank writes its shards; a resume at 2 ranks equals the run that was not interrupted,
    one at 1 rank reads the 2 ranks' shards and trains on; the gathered weights load into the model."""
    common = dict(optimizer={"target": "torch.optim.AdamW", "args": {"lr": 0.003}},
                  checkpoint={"async_write": True, "keep": 2}, fsdp={"units": ["Linear"]}, ema={"decay": 0.8})
    whole = train(ranks, tmp_path / "whole", trainer={"strategy": "fsdp", "epochs": 3}, **common)
    first = train(ranks, tmp_path / "resumed", trainer={"strategy": "fsdp", "epochs": 2}, **common)
    assert epochs(first) == epochs(whole)[:2]
    checkpoints = tmp_path / "resumed" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == [
        "step-000000012.pt", "step-000000012.shards", "step-000000024.pt", "step-000000024.shards"]  # keep: 2
    assert sorted(p.name for p in (checkpoints / "step-000000024.shards").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    import shutil

    shutil.copytree(tmp_path / "resumed", tmp_path / "one_rank")
    resumed = train(ranks, tmp_path / "resumed", trainer={"strategy": "fsdp", "epochs": 3}, **common)
    metrics = ("loss", "eval_loss", "accuracy", "ema_eval_loss", "ema_accuracy")  # the EMA's shards resume too
    assert close([resumed[-1][k] for k in metrics], [epochs(whole)[-1][k] for k in metrics], 1e-6)
    one = train(ranks, tmp_path / "one_rank", world=1, trainer={"strategy": "fsdp", "epochs": 3}, **common)
    last = epochs(one)[-1]
    assert last["epoch"] == 2 and last["step"] == 24 + 23 and last["eval_loss"] < epochs(first)[-1]["eval_loss"]
    from ddpx.models import DigitsMLP

    from safetensors.torch import load_file

    DigitsMLP(hidden=16).load_state_dict(load_file(tmp_path / "one_rank" / "model" / "model.safetensors"))  # strict
    ema = torch.load(tmp_path / "one_rank" / "ema_weights.pt", weights_only=True)
    assert ema["step"] == 47 and ema["updates"] == 47  # 24 updates read from 2 ranks' shards, 23 at 1 rank
    DigitsMLP(hidden=16).load_state_dict(ema["state_dict"])
    assert last["ema_eval_loss"] < epochs(first)[-1]["ema_eval_loss"]


@pytest.mark.slow
def test_fsdp_at_auto_units_trains_a_tied_model_and_its_weights_load_and_export(ranks, tmp_path):
    """nanoGPT's shape (the head tied to the embedding) at fsdp.units=auto on 2 ranks: the blocks are
    units, the tied pair stays in the root; it learns; run_dir/model loads into a fresh model, tied,
    whose loss on the evaluation set is the run's last eval_loss; ``ddpx export`` of the last
    checkpoint (each rank's shards) writes the same tensors."""
    from safetensors.torch import load_file, load_model

    from ddpx.cli import main

    run_dir = tmp_path / "tied"
    lines = train(ranks, run_dir, trainer={"strategy": "fsdp", "epochs": 2, "batch_size": 32},
                  model={"target": "tests.test_fsdp.TiedGPT", "args": {}}, data={"target": "tests.test_fsdp.tied_data"},
                  optimizer={"target": "torch.optim.AdamW", "args": {"lr": 0.01}}, fsdp={"min_unit_params": 300})
    assert "fsdp: 2 units (transformer.h.0, transformer.h.1) + the root sharded over 2 ranks; tied, kept in the " \
           "root: transformer.wte (shares lm_head.weight), lm_head (shares transformer.wte.weight)" in \
           (tmp_path / "rank0.log").read_text()
    first, last = epochs(lines)
    assert last["step"] == 16 and last["eval_loss"] < 0.7 * first["eval_loss"]
    assert last["accuracy"] > 0.1  # 1/32 by chance
    fresh = TiedGPT()
    load_model(fresh, run_dir / "model" / "model.safetensors")
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    x, y = tied_data()[1].dataset[512:]
    with torch.no_grad():
        assert nn.functional.cross_entropy(fresh(x), y).item() == pytest.approx(last["eval_loss"], rel=1e-5)
    assert main(["export", str(run_dir), "--config", str(tmp_path / "tied.yaml"), "--out", str(tmp_path / "out")]) == 0
    written = load_file(run_dir / "model" / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert written.keys() == exported.keys() and all(torch.equal(written[k], exported[k]) for k in written)


@pytest.mark.slow
def test_a_ddp_checkpoint_is_not_resumed_under_fsdp(ranks, tmp_path):
    train(ranks, tmp_path / "run", world=1, trainer={"strategy": "ddp", "epochs": 1})
    path = tmp_path / "run.yaml"
    config = yaml.safe_load(path.read_text())
    config["trainer"]["strategy"] = "fsdp"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(AssertionError, match=r"was saved under trainer.strategy=ddp, this run uses fsdp: resume it "
                                             r"with trainer.strategy=ddp"):
        ranks.train(tmp_path / "run", path, 1, 60)


@pytest.mark.slow
def test_a_refused_plugin_is_one_line_and_exit_2(ranks, tmp_path):
    rc, out, err = ranks.cli(["train", f"run_dir={tmp_path / 'run'}", "trainer.strategy=fsdp",
                              "comm_hook.name=powersgd"], timeout=60)
    assert rc == 2
    assert err.strip().splitlines() == [
        "ddpx: error: comm_hook.name=powersgd does not apply under trainer.strategy=fsdp (only "
        "bf16, fp16 and int8 have a sharded reduce-scatter); set comm_hook.name=int8 (or bf16, fp16, allreduce)"]


@pytest.mark.parametrize("overrides, param_dtype, reduce_dtype", [
    ([], None, torch.float32),
    (["amp.enabled=true", "amp.dtype=bf16"], torch.bfloat16, torch.float32),
    (["amp.enabled=true", "amp.dtype=fp16", "fsdp.reduce_dtype=bf16"], torch.float16, torch.bfloat16),
    (["fsdp.reduce_dtype=bf16"], None, torch.bfloat16),
    (["amp.enabled=true", "amp.dtype=bf16", "fsdp.param_dtype=fp32"], None, torch.float32),  # autocast alone
])
def test_amp_sets_the_compute_dtype_and_fsdp_the_reduce_dtype(overrides, param_dtype, reduce_dtype):
    policy = fsdp.mixed_precision(load_config(None, ["trainer.strategy=fsdp", *overrides]))
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)


@pytest.mark.slow
def test_hsdp_trains_as_ddp_holds_half_and_resumes_exactly(ranks, tmp_path):
    """HSDP on 4 ranks (fsdp.shard_size=2: sharded over 2 ranks, replicated twice): the same losses,
    evaluation and clipped gradient norms as ddp at 4 ranks (the norm sums each shard once, not once
    per replica: that would be sqrt(2) times ddp's); each rank holds half of ddp's parameters and
    gradients; the checkpoint resumes to the numbers of ddp's uninterrupted run."""
    common = dict(world=4, optimizer={"target": "torch.optim.AdamW", "args": {"lr": 0.003}},
                  plugins={"enable": ["benchmarks.shard_memory"]}, ema={"decay": 0.8})
    ddp = train(ranks, tmp_path / "ddp", trainer={"strategy": "ddp", "epochs": 2, "grad_clip": 0.05},
                checkpoint={"enabled": False}, **common)
    hsdp = {"strategy": "fsdp", "grad_clip": 0.05}
    first = train(ranks, tmp_path / "hsdp", trainer={**hsdp, "epochs": 1}, fsdp={"units": ["Linear"], "shard_size": 2},
                  **common)
    resumed = train(ranks, tmp_path / "hsdp", trainer={**hsdp, "epochs": 2}, fsdp={"units": ["Linear"], "shard_size": 2},
                    **common)
    metrics = ("loss", "eval_loss", "accuracy", "ema_eval_loss")
    assert close([epochs(first)[0][k] for k in metrics], [epochs(ddp)[0][k] for k in metrics], 1e-5)
    assert close([epochs(resumed)[-1][k] for k in metrics], [epochs(ddp)[1][k] for k in metrics], 1e-5)
    norms = [[line["grad_norm"] for line in run if "grad_norm" in line] for run in (ddp, resumed)]  # resumed: appended
    assert len(norms[0]) >= 2 and min(norms[0]) > 0.05  # clipping acted
    assert close(norms[1], norms[0], 1e-4)
    held = {name: [json.loads((tmp_path / name / f"shard_memory_rank{r}.json").read_text()) for r in range(4)]
            for name in ("ddp", "hsdp")}
    for rank in range(4):
        for part in ("parameters", "gradients"):
            assert held["hsdp"][rank][part] * 2 == held["ddp"][rank][part], (rank, part)


@pytest.mark.parametrize("setting, world, expected", [("all", 4, 4), (2, 4, 2), (1, 3, 1)])
def test_the_shard_size_is_the_world_or_a_divisor_of_it(setting, world, expected):
    assert fsdp.shard_size(setting, world) == expected
    with pytest.raises(DdpxError, match=r"^fsdp.shard_size=3 does not divide the 4 ranks into shard groups; use a "
                                        r"divisor of 4 \(the ranks of one node, fsdp.shard_size=node\), or all$"):
        fsdp.shard_size(3, 4)


def test_cpu_offload_on_a_cpu_device_is_refused_in_one_line_before_any_collective(make_config):
    """fsdp.offload=cpu is for CUDA: on the CPU the shards are in CPU memory already. wrap refuses
    before it builds the mesh (no process group here: a collective would raise another error)."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    config = make_config("trainer.strategy=fsdp", "fsdp.offload=cpu")
    trainer = SimpleNamespace(config=config, device=torch.device("cpu"), world_size=1)
    with pytest.raises(DdpxError, match=r"^fsdp.offload=cpu moves the shards from GPU memory to CPU memory, but this "
                                        r"run computes on the cpu \(trainer.device\), where they already are; set "
                                        r"fsdp.offload=none$"):
        fsdp.shard_model(trainer, Tiny())
    assert type(fsdp.offload_policy("none", torch.device("cpu"))) is OffloadPolicy
    assert isinstance(fsdp.offload_policy("cpu", torch.device("cuda")), CPUOffloadPolicy)
    with pytest.raises(DdpxError, match=r"config key 'fsdp.offload' must be one of none, cpu"):
        make_config("fsdp.offload=gpu")
