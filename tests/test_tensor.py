"""trainer.strategy: tensor (ddpx/strategies/tensor.py): the plan, the head counts, the fused qkv
layout, the refusals; on gloo ranks the char GPT example trains as ddp (tensor 2, and 2 x 2 replicas),
holds less per rank, resumes exactly, resumes at another tensor size, and writes the user's model."""

import json
import shutil

import pytest
import torch
import yaml
from torch import nn

from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.strategies import tensor, tensor_plan
from test_examples import EXAMPLES


def char_gpt(**kwargs):
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("char_gpt_model", os.path.join(EXAMPLES, "char_gpt", "gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT(**{"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 4, "n_embd": 16,
                         "dropout": 0.0, **kwargs})


class Attention(nn.Module):  # Llama's names and reshapes, grouped-query attention
    def __init__(self, width=16, heads=4, kv_heads=2):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, width // heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj,
                                                                                     self.v_proj))
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(width, 32), nn.Linear(width, 32), nn.Linear(32, width)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.self_attn, self.norm2, self.mlp = nn.LayerNorm(16), Attention(), nn.LayerNorm(16), Mlp()

    def forward(self, x):
        x = x + self.self_attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.fc1 = nn.Linear(16, 16)  # a lone up projection: no partner beside it, left whole
        self.lm_head = nn.Linear(16, 32)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.fc1(h))


class Conv1D(nn.Module):  # transformers.pytorch_utils.Conv1D's shape: a Linear with its weight transposed
    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.weight, self.bias = nf, nn.Parameter(torch.randn(nx, nf)), nn.Parameter(torch.zeros(nf))


def Gpt2Names():
    block = nn.Module()
    block.attn, block.mlp = nn.Module(), nn.Module()
    block.attn.c_attn, block.attn.c_proj = Conv1D(48, 16), Conv1D(16, 16)
    block.mlp.c_fc, block.mlp.c_proj = Conv1D(64, 16), Conv1D(16, 64)
    model = nn.Module()
    model.h, model.lm_head = nn.ModuleList([block]), nn.Linear(16, 32)
    return model


def test_the_auto_plan_splits_the_usual_transformer_pairs_and_a_user_plan_overrides_it():
    split, unmatched = tensor_plan.resolve_plan(char_gpt(), "auto")
    assert split == {"blocks.0.qkv": "qkv", "blocks.0.proj": "rowwise", "blocks.0.mlp.0": "colwise",
                     "blocks.0.mlp.2": "rowwise", "blocks.1.qkv": "qkv", "blocks.1.proj": "rowwise",
                     "blocks.1.mlp.0": "colwise", "blocks.1.mlp.2": "rowwise"}
    assert unmatched == ["head"]
    split, unmatched = tensor_plan.resolve_plan(Llama(), "auto")
    assert {n: s for n, s in split.items() if n.startswith("layers.0.")} == {
        "layers.0.self_attn.q_proj": "colwise", "layers.0.self_attn.k_proj": "colwise",
        "layers.0.self_attn.v_proj": "colwise", "layers.0.self_attn.o_proj": "rowwise",
        "layers.0.mlp.gate_proj": "colwise", "layers.0.mlp.up_proj": "colwise", "layers.0.mlp.down_proj": "rowwise"}
    assert len(split) == 14 and unmatched == ["fc1", "lm_head"]
    # GPT-2's names and Conv1D layers (weights [in, out]; found by class name, transformers not imported)
    split, unmatched = tensor_plan.resolve_plan(Gpt2Names(), "auto")
    assert split == {"h.0.attn.c_attn": "qkv", "h.0.attn.c_proj": "rowwise", "h.0.mlp.c_fc": "colwise",
                     "h.0.mlp.c_proj": "rowwise"}
    assert unmatched == ["lm_head"] and tensor_plan.features(Gpt2Names().h[0].attn.c_attn) == (16, 48)
    # the user's patterns come first: the MLPs left whole, the last layer's attention too
    split, unmatched = tensor_plan.resolve_plan(Llama(), {"mlp.*": "none", "layers.1.self_attn.*": "none"})
    assert sorted(split) == ["layers.0.self_attn.k_proj", "layers.0.self_attn.o_proj", "layers.0.self_attn.q_proj",
                             "layers.0.self_attn.v_proj"]
    # head counts of the modules owning split attention projections are divided (not the head width)
    model = Llama()
    changes = tensor_plan.check_split(model, tensor_plan.resolve_plan(model, "auto")[0], 2)
    assert {(type(m).__name__, a, v) for m, a, v in changes} == {
        ("Attention", "num_heads", 4), ("Attention", "num_key_value_heads", 2)}
    assert len(changes) == 4  # two layers


BERT_PLAN = {"*.attention.self.query": "colwise", "*.attention.self.key": "colwise",
             "*.attention.self.value": "colwise", "*.attention.output.dense": "rowwise",
             "*.intermediate.dense": "colwise", "*.output.dense": "rowwise"}


def hf_models():
    """HuggingFace's Llama (auto plan), BERT (a user plan: its output projection is not beside
    q, k and v) and GPT-2 (auto plan, Conv1D layers), tiny and random; {} without transformers."""
    try:
        import transformers
    except ImportError:
        return {}
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=16)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **small))
    bert = transformers.BertModel(transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                          **small))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(  # Conv1D layers
        vocab_size=32, n_embd=16, n_layer=2, n_head=4, n_positions=16, bos_token_id=0, eos_token_id=0))
    return {"hf_llama": (llama, "auto"), "hf_bert": (bert, BERT_PLAN), "hf_gpt2": (gpt2, "auto")}


def split_models(rank, world):
    """On ``world`` ranks, each model split by its plan against an unsplit copy: the output, a split
    gradient (the Llama's), the head counts and the gathered state dict."""
    import copy
    import logging
    import types

    torch.manual_seed(0)
    results = {}
    for kind, (model, plan) in {"llama": (Llama(), "auto"), **hf_models()}.items():
        model.eval()  # BERT's dropout is 0; the same path everywhere
        whole = copy.deepcopy(model)
        config = types.SimpleNamespace(tensor=types.SimpleNamespace(size=world, plan=plan),
                                       trainer=types.SimpleNamespace(strategy="tensor"))
        trainer = types.SimpleNamespace(config=config, world_size=world, device=torch.device("cpu"),
                                        log=logging.getLogger("test_tensor"))
        strategy = tensor.TensorStrategy(config)
        strategy.wrap(trainer, model)
        x = torch.randint(32, (3, 5), generator=torch.Generator().manual_seed(1))
        out, expected = (m(x) if kind == "llama" else m(x)[0] for m in (model, whole))
        result = {"output": (out - expected).abs().max().item()}
        if kind == "llama":
            out.square().mean().backward()
            expected.square().mean().backward()
            grad = model.layers[0].self_attn.k_proj.weight.grad.full_tensor()
            result.update(grad=(grad - whole.layers[0].self_attn.k_proj.weight.grad).abs().max().item(),
                          heads=(model.layers[0].self_attn.num_heads, model.layers[0].self_attn.num_key_value_heads),
                          held=tuple(model.layers[0].self_attn.k_proj.weight.to_local().shape))
        if kind == "hf_bert":
            attention = model.encoder.layer[0].attention.self
            result["heads"] = (attention.num_attention_heads, attention.all_head_size)
        if kind == "hf_gpt2":
            attention = model.transformer.h[0].attn
            result["heads"] = (attention.num_heads, attention.split_size, attention.head_dim)
            result["held"] = tuple(attention.c_attn.weight.to_local().shape)
        state = strategy.full_state_dict(model)
        result["state"] = max((state[k] - v).abs().max().item() for k, v in whole.state_dict().items()) if state \
            else None
        results[kind] = result
    return results


@pytest.mark.slow
def test_llama_and_bert_shaped_models_split_as_their_plans_say(ranks):
    """On 2 ranks: a Llama-shaped model with grouped-query attention (4 heads, 2 key-value heads) under
    the auto plan computes 2 heads and 1 key-value head per rank with the unsplit model's output and
    gradients; HuggingFace's Llama (auto plan, reshapes with -1), BERT (a plan of the user's, its
    head count and width divided) and GPT-2 (auto plan, Conv1D layers, its c_attn split by columns)
    give their unsplit outputs; rank 0 gathers each state dict."""
    results = ranks.call(split_models, 2, timeout=90)
    for result in results:
        llama = result["llama"]
        assert llama["heads"] == (2, 1) and llama["held"] == (4, 16)  # 1 key-value head of width 4
        assert llama["output"] < 1e-6 and llama["grad"] < 1e-6, llama
        for kind in ("hf_llama", "hf_bert", "hf_gpt2"):
            if kind in result:
                assert result[kind]["output"] < 1e-5, (kind, result[kind])
        if "hf_bert" in result:
            assert result["hf_bert"]["heads"] == (2, 8)
        if "hf_gpt2" in result:  # 2 heads of width 4 per rank: c_attn's weight [16, 3 x 16] split on its columns
            assert result["hf_gpt2"]["heads"] == (2, 8, 4) and result["hf_gpt2"]["held"] == (16, 24)
    assert all(r["state"] == 0.0 for r in results[0].values()) and all(r["state"] is None for r in results[1].values())


def test_what_the_plan_and_the_size_cannot_split_is_one_line():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(DdpxError, match=r"^tensor.plan=auto splits none of Sequential's Linear modules \(0, 2\); name "
                                        r"them in tensor.plan, a colwise layer followed by a rowwise one, e\.g\. "
                                        r"tensor.plan=\{\"\*\.up\": colwise, \"\*\.down\": rowwise\}"):
        tensor_plan.resolve_plan(mlp, "auto")
    assert tensor_plan.resolve_plan(mlp, {"0": "colwise", "2": "rowwise"})[0] == {"0": "colwise", "2": "rowwise"}
    with pytest.raises(DdpxError, match=r"^tensor.plan names 'up', which matches no nn.Linear module of Sequential "
                                        r"\(its Linear modules: 0, 2\)$"):
        tensor_plan.resolve_plan(mlp, {"up": "colwise"})
    model = char_gpt()
    split = tensor_plan.resolve_plan(model, "auto")[0]
    with pytest.raises(DdpxError, match=r"^tensor.size=3 does not divide the 4 heads of blocks.0 \(Block.n_head\): "
                                        r"each rank computes whole heads; set tensor.size to a divisor of 4$"):
        tensor_plan.check_split(model, split, 3)
    gqa = Attention()  # a fused projection of grouped-query attention: its thirds are not equal
    gqa.qkv = nn.Linear(16, 32)
    with pytest.raises(DdpxError, match=r"^qkv is split as a fused \[q; k; v\] of equal thirds \(style qkv\), but the "
                                        r"model has grouped-query attention \(Attention.num_key_value_heads=2, 4 query "
                                        r"heads\); leave it whole"):
        tensor_plan.check_split(gqa, {"qkv": "qkv", "o_proj": "rowwise"}, 2)
    with pytest.raises(DdpxError, match=r"^tensor.size=4 does not divide 0 \(colwise, 6 output features\) evenly"):
        tensor_plan.check_split(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4)), {"0": "colwise", "1": "rowwise"}, 4)


@pytest.mark.parametrize("overrides, message", [
    (["tensor.plan={qkv: fused}"], "tensor.plan gives 'qkv' the style 'fused'; a style is one of colwise, rowwise, "
                                   "qkv, none"),
    (["tensor.plan=megatron"], "config key 'tensor.plan' must be auto or a mapping {pattern: style}"),
    (["tensor.size=0"], "config key 'tensor.size' must be >= 1 (ranks each layer is split over), got 0"),
    (["comm_hook.name=onebit_adam", "optimizer.target=ddpx.optim.OneBitAdam", "optimizer.args={lr: 0.001}"],
     "comm_hook.name=onebit_adam does not apply under trainer.strategy=tensor (its optimizer sends its update "
     "through DDP, which cannot hold a tensor-parallel model); set comm_hook.name to one of allreduce, bf16, fp16, "
     "int8, onebit, powersgd"),
    (["comm_hook.name=int8", "comm_hook.options={blocksize: 3}"], "comm hook 'int8': unknown option(s) blocksize"),
    (["amp.enabled=true", "amp.dtype=fp16"], "amp.dtype=fp16 does not apply under trainer.strategy=tensor (the fp16 "
                                             "GradScaler cannot unscale a mix of DTensor and plain gradients); set "
                                             "amp.dtype=bf16"),
    (["trainer.compile=true"], "trainer.compile does not apply under trainer.strategy=tensor"),
])
def test_what_tensor_refuses_in_the_config_is_one_line(overrides, message):
    with pytest.raises(DdpxError) as caught:
        load_config(None, ["trainer.strategy=tensor", *overrides])
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_world_the_size_does_not_divide_is_one_line_before_any_collective():
    from types import SimpleNamespace

    from ddpx.strategies.mesh import model_parallel_mesh

    trainer = SimpleNamespace(world_size=3, device=torch.device("cpu"))
    with pytest.raises(DdpxError, match=r"^tensor.size=2 does not divide the 3 ranks into groups of 2; set tensor.size "
                                        r"to one of 1, 3, or start a multiple of 2 ranks \(launch.nproc_per_node x "
                                        r"launch.nnodes\)$"):
        model_parallel_mesh(trainer, 2, "tp", "tensor.size")


def test_a_fused_qkv_rank_holds_its_heads_rows_and_the_layout_round_trips():
    rows = torch.arange(12.0).repeat_interleave(2).view(12, 2)  # q = rows 0-3, k = 4-7, v = 8-11
    permuted = tensor.permute_fused(rows, 2)
    assert permuted[:6, 0].tolist() == [0, 1, 4, 5, 8, 9]  # rank 0: q_0, k_0, v_0
    assert permuted[6:, 0].tolist() == [2, 3, 6, 7, 10, 11]
    assert torch.equal(tensor.unpermute_fused(permuted, 2), rows)
    assert torch.equal(tensor.permute_fused(rows, 1), rows)
    columns = rows.T.contiguous()  # a Conv1D's weight [in, 3 x out]: the fused parts are its columns
    assert torch.equal(tensor.permute_fused(columns, 2, dim=1), permuted.T)
    assert torch.equal(tensor.unpermute_fused(permuted.T, 2, dim=1), columns)


# --- gloo ranks: the char GPT example -----------------------------------------------------------

CONFIG = {
    "seed": 0,
    "model": {"target": "gpt.GPT", "args": {"vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 4,
                                            "n_embd": 64, "dropout": 0.0}},
    "data": {"target": "text.splits", "args": {"block_size": 32, "val_fraction": 0.1}},
    "loss": {"target": None},
    "optimizer": {"target": "torch.optim.AdamW", "args": {"lr": 0.002, "betas": [0.9, 0.99], "weight_decay": 0.1}},
    "trainer": {"epochs": 1, "max_steps": 10, "batch_size": 16, "eval_batch_size": 256, "grad_clip": 1.0,
                "backend": "gloo", "device": "cpu"},
    "logging": {"every_steps": 1, "progress": False},
    "checkpoint": {"enabled": False},
    "comm_monitor": {"enabled": False},
}


def example(tmp_path):
    for name in ("gpt.py", "text.py", "sonnets.txt"):
        shutil.copy(f"{EXAMPLES}/char_gpt/{name}", tmp_path / name)


def train(ranks, tmp_path, name, world, timeout=60, **sections):
    """Train the char GPT on ``world`` ranks (ddpx.worker); rank 0's metrics.jsonl lines."""
    config = json.loads(json.dumps(CONFIG))
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    run_dir = tmp_path / name
    config["run_dir"] = str(run_dir)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    ranks.train(run_dir, path, world, timeout)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps(lines):
    return [line for line in lines if line["kind"] == "step"]


def numbers(lines):
    return [(s["step"], s["loss"], s["grad_norm"]) for s in steps(lines)]


def last_eval(lines):
    return [line for line in lines if "eval_loss" in line][-1]


def gap(a, b, key):
    return max(abs(x[key] - y[key]) for x, y in zip(a, b))


# the tensor-2 run both tests below compare with: checkpoints, an EMA and shard_memory's record (none of them
# changes a number the tests read; each test's own runs have the same sections)
TENSOR2 = dict(checkpoint={"enabled": True}, ema={"decay": 0.8}, plugins={"enable": ["benchmarks.shard_memory"]})


@pytest.fixture(scope="module")
def tensor2(ranks, tmp_path_factory):
    """tensor 2 on 2 ranks, 10 steps: rank 0's metrics.jsonl lines and its run_dir."""
    tmp = tmp_path_factory.mktemp("tensor2")
    example(tmp)
    return train(ranks, tmp, "tp2", 2, trainer={"strategy": "tensor"}, **TENSOR2), tmp / "tp2"


@pytest.mark.slow
def test_tensor_trains_as_ddp_holds_less_and_writes_the_users_model(ranks, tmp_path, tensor2):
    """10 AdamW steps, a clip that acts: tensor 2, and tensor 2 x 2 replicas with 2 micro-batches a step
    (the replicas' average waits for the window's last: the same 16 samples a step), give ddp's
    losses, gradient norms and evaluation within 1e-5; a rank holds what the split divides by 2 of
    ddp's parameters and optimizer state; run_dir/model loads strictly into the user's unsplit class
    (tied head and all) and holds ddp's weights. comm_hook.name=int8 compresses the replicas'
    average and trains as fp32 does, within 0.1 %."""
    from safetensors.torch import load_file, load_model

    example(tmp_path)
    memory = {"plugins": {"enable": ["benchmarks.shard_memory"]}}
    ddp1 = train(ranks, tmp_path, "ddp1", 1, **memory)
    tp2, tp2_dir = tensor2
    int8 = train(ranks, tmp_path, "int8", 4, trainer={"strategy": "tensor", "batch_size": 8},
                 comm_hook={"name": "int8"})
    assert "comm hook int8 installed on the gradient average of 2 replicas (fused buckets of each rank's parts, the " \
           "whole layers' apart" in \
        (tmp_path / "rank0.log").read_text()
    tp2x2 = train(ranks, tmp_path, "tp2x2", 4, trainer={"strategy": "tensor", "batch_size": 4},
                  accumulation={"steps": 2})  # 2 replicas x 4 x 2 micro-batches: ddp1's 16 samples a step
    log = (tmp_path / "rank0.log").read_text()
    assert "tensor: 8 Linear layers split over 2 ranks x 2 replicas (qkv blocks.0.qkv, blocks.1.qkv; colwise " \
           "blocks.0.mlp.0, blocks.1.mlp.0; rowwise blocks.0.proj, blocks.0.mlp.2, blocks.1.proj, blocks.1.mlp.2); " \
           "per rank: Block.n_head 4 -> 2; not split (whole on every rank): head" in log
    assert len(steps(tp2)) == 10 == len(steps(ddp1)) and gap(steps(tp2), steps(ddp1), "loss") < 1e-5
    for split in (tp2, tp2x2):  # tp2x2's steps log replica 0's half of the batch: its epoch loss is the mean
        assert gap(steps(split), steps(ddp1), "grad_norm") < 1e-5 and min(s["grad_norm"] for s in steps(ddp1)) > 1.0
        for key in ("loss", "eval_loss"):
            assert abs(last_eval(split)[key] - last_eval(ddp1)[key]) < 1e-5, key
    # int8 on the replicas' average: about 3.5x fewer bytes than fp32's, the evaluation within 0.1 %
    assert all(3.0 < s["comm_compression"] < 4.0 for s in steps(int8))
    assert abs(last_eval(int8)["eval_loss"] - last_eval(ddp1)["eval_loss"]) < 1e-3 * last_eval(ddp1)["eval_loss"]
    dirs = {"ddp1": tmp_path / "ddp1", "tp2": tp2_dir, "tp2x2": tmp_path / "tp2x2"}
    held = {name: json.loads((dirs[name] / "shard_memory_rank0.json").read_text()) for name in ("ddp1", "tp2")}
    model = char_gpt(vocab_size=128, block_size=32, n_embd=64)
    split = tensor_plan.resolve_plan(model, "auto")[0]
    split_params = sum(p.numel() for name in split for pn, p in model.get_submodule(name).named_parameters()
                       if not (split[name] == "rowwise" and pn == "bias"))  # a rowwise bias stays whole
    whole = sum(p.numel() for p in model.parameters())
    expected = (whole - split_params / 2) / whole
    for part in ("parameters", "optimizer"):
        assert held["tp2"][part] / held["ddp1"][part] == pytest.approx(expected, rel=1e-3), part
    assert 0.5 < expected < 0.75
    written = {name: load_file(dirs[name] / "model" / "model.safetensors") for name in ("ddp1", "tp2", "tp2x2")}
    load_model(model, tp2_dir / "model" / "model.safetensors")  # strict: the user's keys and shapes
    assert model.head.weight is model.tok.weight  # the tied head, written once
    model.load_state_dict({**written["tp2"], "head.weight": written["tp2"]["tok.weight"]})
    for name in ("tp2", "tp2x2"):
        assert written[name].keys() == written["ddp1"].keys()
        assert max((written[name][k] - v).abs().max().item() for k, v in written["ddp1"].items()) < 2e-5


@pytest.mark.slow
def test_tensor_resumes_exactly_and_at_another_tensor_size(ranks, tmp_path, tensor2):
    """Each rank writes its parts (a fused qkv as its q, k, v: the user's layout); a run stopped at step
    5 and resumed equals the uninterrupted one at step 10, the EMA too, and ``ddpx export`` of its last
    checkpoint writes the weights the run wrote; resumed at tensor.size 4 on 4 ranks instead, it trains
    to step 10 as the uninterrupted run did (within 1e-5)."""
    example(tmp_path)
    common = TENSOR2
    whole = tensor2[0]  # the same run, uninterrupted
    first = train(ranks, tmp_path, "cut", 2, trainer={"strategy": "tensor", "max_steps": 5}, **common)
    assert numbers(first) == numbers(whole)[:5]
    from ddpx.strategies.shards import _reader_classes

    reader, _ = _reader_classes()
    stored = reader(str(tmp_path / "cut" / "checkpoints" / "step-000000005.shards")).read_metadata()
    qkv = {key: meta.size for key, meta in stored.state_dict_metadata.items() if key.startswith("model.blocks.0.qkv")}
    assert qkv == {"model.blocks.0.qkv.weight.q": (64, 64), "model.blocks.0.qkv.weight.k": (64, 64),
                   "model.blocks.0.qkv.weight.v": (64, 64), "model.blocks.0.qkv.bias.q": (64,),
                   "model.blocks.0.qkv.bias.k": (64,), "model.blocks.0.qkv.bias.v": (64,)}
    shutil.copytree(tmp_path / "cut", tmp_path / "four")
    resumed = train(ranks, tmp_path, "cut", 2, trainer={"strategy": "tensor"}, **common)
    assert numbers(resumed)[-5:] == numbers(whole)[5:]
    # ddpx export reads the step-10 parts into the unsplit model: the weights the run wrote at its end
    from safetensors.torch import load_file

    from ddpx.cli import main

    assert main(["export", str(tmp_path / "cut"), "--config", str(tmp_path / "cut.yaml"), "--out",
                 str(tmp_path / "out")]) == 0
    written, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("cut/model", "out"))
    assert written.keys() == exported.keys() and all(torch.equal(written[k], exported[k]) for k in written)
    for key in ("eval_loss", "ema_eval_loss"):
        assert last_eval(resumed)[key] == last_eval(whole)[key], key
    four = train(ranks, tmp_path, "four", 4, trainer={"strategy": "tensor"}, tensor={"size": 4}, **common)
    assert "resuming with 1 data-parallel replica (4 ranks) from a checkpoint of 1 (2 ranks): the rest of epoch 0 is " \
           "re-divided, the global batch is now 1 replica x 16 x 1 accumulation steps = 16 samples, RNG states are " \
           "seeded from (seed, replica, step)" in (tmp_path / "rank0.log").read_text()
    after = steps(four)[5:]  # the run directory holds the first 5 steps' lines too
    assert [s["step"] for s in after] == [6, 7, 8, 9, 10]
    assert gap(after, steps(whole)[5:], "loss") < 1e-5 and gap(after, steps(whole)[5:], "grad_norm") < 1e-5
    for key in ("eval_loss", "ema_eval_loss"):
        assert abs(last_eval(four)[key] - last_eval(whole)[key]) < 1e-5, key


@pytest.mark.slow
def test_bad_tensor_setups_are_one_line_and_exit_2(ranks, tmp_path):
    example(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "trainer": {**CONFIG["trainer"], "strategy": "tensor"}}))
    cases = [  # one rank: these are refused before the ranks are grouped
        (["tensor.size=3"], "tensor.size=3 does not divide the 4 heads of blocks.0 (Block.n_head): each rank computes "
                            "whole heads; set tensor.size to a divisor of 4"),
        (["model.target=ddpx.models.DigitsMLP", "model.args={hidden: 16}", "loss.target=torch.nn.CrossEntropyLoss",
          "data.target=ddpx.data.digits_split", "data.args={}"],
         "tensor.plan=auto splits none of DigitsMLP's Linear modules (net.0, net.2, net.4); name them in "
         "tensor.plan"),
    ]
    for args, message in cases:
        rc, out, err = ranks.cli(["train", str(config), f"run_dir={tmp_path / 'run'}", "--nproc-per-node", "1", *args],
                                 cwd=tmp_path,
                                 timeout=60)
        errors = [line for line in err.splitlines() if line.startswith("ddpx: error:")]
        assert rc == 2 and len(errors) == 1, err[-2000:]
        assert message in errors[0], errors[0]


GPT2_MODEL = '''from transformers import GPT2Config, GPT2LMHeadModel


def gpt2(**args):
    return GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0, **args))
'''
GPT2_DATA = '''from torch.utils.data import Dataset

from text import splits


class Causal(Dataset):  # HuggingFace's batch: the model shifts the labels itself
    def __init__(self, windows):
        self.windows = windows

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        x = self.windows[i]["idx"]
        return {"input_ids": x, "labels": x}


def causal_splits(**args):
    return tuple(map(Causal, splits(**args)))
'''


@pytest.mark.slow
def test_hf_gpt2_conv1d_layers_split_and_train_as_ddp(ranks, tmp_path):
    """HuggingFace's GPT-2 (Conv1D layers: weights [in, out], a fused c_attn split by width) under the
    auto plan on 2 ranks: 6 AdamW steps (stopped at 3 and resumed) give ddp's losses and evaluation within
    1e-5; run_dir/model loads with
    GPT2LMHeadModel.from_pretrained (the head still tied) and holds ddp's weights; the checkpoint holds
    c_attn as q, k, v parts of the user's layout and ``ddpx export`` writes the weights the run wrote."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from ddpx.cli import main
    from ddpx.strategies.shards import _reader_classes

    example(tmp_path)
    (tmp_path / "gpt2_model.py").write_text(GPT2_MODEL)
    (tmp_path / "gpt2_data.py").write_text(GPT2_DATA)
    args = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, tie_word_embeddings=True)
    common = dict(model={"target": "gpt2_model.gpt2", "args": args}, data={"target": "gpt2_data.causal_splits"})
    ddp1 = train(ranks, tmp_path, "ddp1", 1, trainer={"max_steps": 6}, **common)
    train(ranks, tmp_path, "tp2", 2, trainer={"strategy": "tensor", "max_steps": 3}, checkpoint={"enabled": True},
          **common)
    log = (tmp_path / "rank0.log").read_text()
    tp2 = train(ranks, tmp_path, "tp2", 2, trainer={"strategy": "tensor", "max_steps": 6},
                checkpoint={"enabled": True}, **common)  # resumed at step 3
    assert "resumed from " in (tmp_path / "rank0.log").read_text() and "step-000000003.pt (epoch 0, step 3)" in \
        (tmp_path / "rank0.log").read_text()
    assert "tensor: 8 Linear layers split over 2 ranks x 1 replica (qkv transformer.h.0.attn.c_attn, " \
           "transformer.h.1.attn.c_attn; colwise transformer.h.0.mlp.c_fc, transformer.h.1.mlp.c_fc; rowwise " \
           "transformer.h.0.attn.c_proj, transformer.h.0.mlp.c_proj, transformer.h.1.attn.c_proj, " \
           "transformer.h.1.mlp.c_proj); per rank: GPT2Attention.embed_dim 64 -> 32, GPT2Attention.num_heads 4 -> 2, " \
           "GPT2Attention.split_size 64 -> 32; not split (whole on every rank): lm_head" in log
    assert [s["step"] for s in steps(tp2)] == list(range(1, 7)) and gap(steps(tp2), steps(ddp1), "loss") < 1e-5
    assert abs(last_eval(tp2)["eval_loss"] - last_eval(ddp1)["eval_loss"]) < 1e-5  # (its epoch loss: steps 4-6)
    models = {name: transformers.GPT2LMHeadModel.from_pretrained(tmp_path / name / "model") for name in ("ddp1", "tp2")}
    assert models["tp2"].lm_head.weight is models["tp2"].transformer.wte.weight
    whole = {name: model.state_dict() for name, model in models.items()}
    assert max((whole["tp2"][k] - v).abs().max().item() for k, v in whole["ddp1"].items()) < 2e-5
    shards = tmp_path / "tp2" / "checkpoints" / "step-000000006.shards"
    stored = _reader_classes()[0](str(shards)).read_metadata().state_dict_metadata
    assert {k: tuple(m.size) for k, m in stored.items() if k.startswith("model.transformer.h.0.attn.c_attn")} == {
        f"model.transformer.h.0.attn.c_attn.{p}.{part}": size for p, size in (("weight", (64, 64)), ("bias", (64,)))
        for part in "qkv"}
    assert main(["export", str(tmp_path / "tp2"), "--config", str(tmp_path / "tp2.yaml"), "--out",
                 str(tmp_path / "out")]) == 0
    written, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("tp2/model", "out"))
    assert written.keys() == exported.keys() and all(torch.equal(written[k], exported[k]) for k in written)
