"""The trained model out of a run (ddpx/rank/model_files.py) and ``ddpx export`` (ddpx/cli/export.py):
safetensors with tied weights once, the torch.save fallback, a HuggingFace model's config.json,
and an export from a replicated checkpoint equal to the run's own files. The export of fsdp's
shards is in tests/test_fsdp.py (a run that wrote them)."""

import json
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model
from torch import nn

from ddpx.cli import main
from ddpx.rank.checkpoint_files import CheckpointDirectory
from ddpx.rank.model_files import HF_CONFIG, SAFETENSORS, TORCH_WEIGHTS, write_model


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(4.0))


def copies(model):
    """The state dict as a strategy gives it: each entry its own CPU copy (the tie is not in it)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_tied_weights_are_written_once_and_without_safetensors_torch_save_keeps_the_tie(tmp_path, monkeypatch):
    model = Tied()
    assert write_model(copies(model), tmp_path, model) == ([SAFETENSORS], "")
    assert sorted(load_file(tmp_path / SAFETENSORS)) == ["embed.weight", "scale"]
    with safe_open(tmp_path / SAFETENSORS, "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what from_pretrained checks
    fresh = Tied()
    load_model(fresh, tmp_path / SAFETENSORS)
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.head.weight, model.head.weight)

    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # not installed
    written, why = write_model(copies(model), tmp_path, model)
    assert (written, why) == ([TORCH_WEIGHTS], "the safetensors package is not installed (pip install safetensors)")
    assert sorted(p.name for p in tmp_path.iterdir()) == [TORCH_WEIGHTS]  # the earlier safetensors file is gone
    state = torch.load(tmp_path / TORCH_WEIGHTS, weights_only=True)
    assert sorted(state) == ["embed.weight", "head.weight", "scale"]
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()  # one tensor, written once
    Tied().load_state_dict(state)  # strict
    monkeypatch.undo()
    odd = {**copies(model), "_extra_state": 3}
    assert write_model(odd, tmp_path, model)[1] == "its entry _extra_state is not a tensor"


class Config:
    def __init__(self):
        self.architectures, self.n_embd = None, 4

    def to_json_string(self):
        return json.dumps(vars(self))

    def to_json_file(self, path):
        raise AssertionError("config.json is written through to_json_string")


class HFTied(Tied):
    """What a HuggingFace model offers the writer: save_pretrained and a config."""

    def __init__(self):
        super().__init__()
        self.config = Config()

    def save_pretrained(self, directory):
        raise AssertionError("the writer writes the files itself")


def test_a_huggingface_model_gets_the_config_json_of_its_own_class(tmp_path):
    sharded = type("FSDPHFTied", (HFTied,), {"__module__": "torch.distributed.fsdp._fully_shard._fully_shard"})
    model = sharded()  # FSDP2 turns the model into a subclass of its own, in place
    assert write_model(copies(model), tmp_path, model) == ([SAFETENSORS, HF_CONFIG], "")
    assert json.loads((tmp_path / HF_CONFIG).read_text()) == {"architectures": ["HFTied"], "n_embd": 4}
    assert model.config.architectures is None  # the model's own config is left as it was


def test_export_writes_a_replicated_checkpoint_as_the_run_does(tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text("model: {target: torch.nn.Linear, args: {in_features: 4, out_features: 3}}\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert main(["export", str(run_dir)]) == 2
    assert capsys.readouterr().err == (f"ddpx: error: {run_dir} has no readable ddpx-launch.json (ddpx train writes "
                                       "it), so its config is unknown; give it: ddpx export RUN_DIR --config YAML "
                                       "[KEY=VALUE ...]\n")
    (run_dir / "ddpx-launch.json").write_text(json.dumps({"config": str(config), "overrides": [], "started": 0}))
    trained = nn.Linear(4, 3)
    path = CheckpointDirectory(run_dir / "checkpoints").save(
        {"step": 7, "world_size": 2, "strategy": "ddp", "replicated": {"model": trained.state_dict()}, "ranks": []}, 7)
    assert main(["export", str(run_dir)]) == 0
    assert capsys.readouterr().err == (f"ddpx: wrote {run_dir / 'model'}: {SAFETENSORS} from {path} (step 7)\n")
    exported = load_file(run_dir / "model" / SAFETENSORS)
    assert exported.keys() == trained.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in trained.state_dict().items())
    assert main(["export", str(run_dir), "model.args.out_features=5", "--out", str(tmp_path / "other")]) == 2
    assert capsys.readouterr().err.startswith(f"ddpx: error: checkpoint {path} holds another model's weights than "
                                              "torch.nn.Linear builds (Error(s) in loading state_dict for Linear: "
                                              "size mismatch for weight")
    assert not (tmp_path / "other").exists()


def test_export_names_a_file_that_is_not_a_checkpoint_and_writes_the_ema_weights(tmp_path, capsys):
    """``--checkpoint some.yaml`` said torch's "Unsupported operand 109"; ``--ema`` writes the EMA
    weights the ema plugin wrote at the run's end (ema_weights.pt) with the same writer."""
    config = tmp_path / "cfg.yaml"
    config.write_text("model: {target: torch.nn.Linear, args: {in_features: 4, out_features: 3}}\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ddpx-launch.json").write_text(json.dumps({"config": str(config), "overrides": [], "started": 0}))
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"weight": torch.zeros(3, 4)}, tmp_path / "state.pt")
    instead = f"give a step-N.pt of {run_dir / 'checkpoints'}, or leave --checkpoint out for the newest"
    for given, why in [(config, "is not a ddpx checkpoint (a text file)"),
                       (tmp_path / "empty.pt", "is not a ddpx checkpoint (an empty file)"),
                       (tmp_path / "state.pt", "is not a ddpx checkpoint (a file torch.save wrote, without "
                                               "ddpx_checkpoint_format)"),
                       (tmp_path / "gone.pt", ": no such file")]:
        assert main(["export", str(run_dir), "--checkpoint", str(given)]) == 2
        assert capsys.readouterr().err == f"ddpx: error: --checkpoint {given} {why}; {instead}\n".replace(" :", ":")

    assert main(["export", str(run_dir), "--ema"]) == 2
    assert capsys.readouterr().err == (f"ddpx: error: {run_dir / 'ema_weights.pt'} does not exist: a run with "
                                       "ema.decay set writes it when its training ends (the checkpoints hold the raw "
                                       f"weights: ddpx export {run_dir} without --ema)\n")
    averaged = nn.Linear(4, 3)
    torch.save({"weights": "ema", "decay": 0.9, "step": 12, "updates": 12, "state_dict": averaged.state_dict()},
               run_dir / "ema_weights.pt")  # as plugins/ddpx_plugins/ema.py writes it
    assert main(["export", str(run_dir), "--ema"]) == 0
    assert capsys.readouterr().err == (f"ddpx: wrote {run_dir / 'model-ema'}: {SAFETENSORS} from "
                                       f"{run_dir / 'ema_weights.pt'} (the EMA weights of step 12)\n")
    exported = load_file(run_dir / "model-ema" / SAFETENSORS)
    assert exported.keys() == averaged.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in averaged.state_dict().items())
    assert main(["export", str(run_dir), "--checkpoint", str(run_dir / "ema_weights.pt")]) == 2
    assert capsys.readouterr().err == (f"ddpx: error: --checkpoint {run_dir / 'ema_weights.pt'} holds the EMA weights "
                                       f"of a run's end, not a checkpoint: ddpx export {run_dir} --ema writes them\n")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
