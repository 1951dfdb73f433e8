"""The trained model as files a user loads without ddpx: the one writer of ``run_dir/model/``.

:func:`write_model` takes the whole model's state dict (what ``Strategy.full_state_dict``
gives, or a checkpoint's model read back by ``ddpx export``) and the model it belongs to,
and writes into one directory:

* ``model.safetensors``: every entry once; a parameter the model ties to another (a
  language model's input embedding and output head) is written under its first name only
  (:func:`tied_names`), as HuggingFace's ``save_pretrained`` does. Load it with
  ``safetensors.torch.load_model(model, path)``, which knows the ties;
* ``config.json`` too for a HuggingFace model (one with ``save_pretrained`` and a
  ``config``): the directory is one ``from_pretrained`` reads;
* ``model_weights.pt`` instead (``torch.save`` of the whole state dict, tied entries one
  tensor, for ``model.load_state_dict(torch.load(path))``) where safetensors cannot hold
  the weights: the package is not installed, or an entry is not a tensor.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import torch
from torch import nn

from .checkpoint_files import atomic_write

MODEL_DIR = "model"  # in run_dir: the trained model, written at the end of every run
SAFETENSORS = "model.safetensors"
TORCH_WEIGHTS = "model_weights.pt"  # the fallback where safetensors cannot hold the weights
HF_CONFIG = "config.json"


def names_by_tensor(named) -> list:
    """The names of ``named`` (``(name, tensor)`` pairs, a tensor under several names included)
    grouped by tensor, each group and the groups in the order of first appearance."""
    groups: dict = {}
    for name, tensor in named:
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def tied_names(model: nn.Module) -> dict:
    """``{name: the name it is tied to}`` for every parameter or buffer name of ``model`` that
    names a tensor another, earlier name (in ``named_parameters`` order) names too."""
    named = itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    return {name: group[0] for group in names_by_tensor(named) for name in group[1:]}


def model_class(model: nn.Module) -> type:
    """The user's class of ``model`` (FSDP2 makes its own subclass of it in place)."""
    return next(c for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed"))


def is_hf_model(model: nn.Module) -> bool:
    """A HuggingFace ``transformers`` model: ``save_pretrained`` and a config that writes JSON."""
    return hasattr(model, "save_pretrained") and hasattr(getattr(model, "config", None), "to_json_file")


def write_model(state: dict, directory: Path, model: nn.Module) -> tuple[list, str]:
    """Write ``state`` (``model``'s whole state dict, CPU tensors) into ``directory``; returns
    the files written and, where safetensors could not hold the weights, why (else "")."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tied = {k: v for k, v in tied_names(model).items() if k in state and v in state}
    why = _write_safetensors({k: v for k, v in state.items() if k not in tied}, directory / SAFETENSORS)
    if why:
        whole = {k: state[tied.get(k, k)] for k in state}  # a tied entry: the tensor of the name it is tied to
        atomic_write(directory / TORCH_WEIGHTS, lambda f: torch.save(whole, f))
    (directory / (SAFETENSORS if why else TORCH_WEIGHTS)).unlink(missing_ok=True)  # an earlier write's
    written = [TORCH_WEIGHTS if why else SAFETENSORS]
    if is_hf_model(model):
        config = copy.deepcopy(model.config)
        config.architectures = [model_class(model).__name__]  # as save_pretrained records it
        atomic_write(directory / HF_CONFIG, lambda f: f.write(config.to_json_string().encode()))
        written.append(HF_CONFIG)
    return written, why


def _write_safetensors(tensors: dict, path: Path) -> str:
    """Write ``tensors`` as safetensors; "" when written, else why not."""
    try:
        from safetensors.torch import save  # bytes: save_file holds as many in memory, and replaces the file
    except ImportError:
        return "the safetensors package is not installed (pip install safetensors)"
    odd = next((k for k, v in tensors.items() if not isinstance(v, torch.Tensor)), None)
    if odd is not None:
        return f"its entry {odd} is not a tensor"
    try:
        data = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})  # from_pretrained's
    except (RuntimeError, ValueError) as exc:  # e.g. two entries that are views of one storage
        return f"safetensors refused them: {str(exc).splitlines()[0]}"
    atomic_write(path, lambda f: f.write(data))
    return ""
