"""The plan of ``trainer.strategy: tensor`` (ddpx/strategies/tensor.py): which of a model's
``nn.Linear`` (and HuggingFace ``Conv1D``) layers a tensor group splits, in which style, and the
head counts and widths of the modules that own them, checked before anything is split."""

from __future__ import annotations

import fnmatch
import torch
from torch import nn

from ..errors import DdpxError


STYLES = ("colwise", "rowwise", "qkv", "none")
# tensor.plan: auto. A pattern matches a Linear module's name relative to the model (fnmatch, case
# sensitive) or the tail of it after a dot ("proj" matches "blocks.0.proj"); the first match wins.
# A built-in match is kept only where the module's parent also has a match of the other kind (a
# colwise or qkv layer and a rowwise one): a rowwise layer takes a split input, a colwise layer
# gives one.
AUTO_PLAN = (
    *((name, "qkv") for name in ("qkv", "c_attn", "Wqkv")),
    *((name, "colwise") for name in ("q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv")),
    *((name, "colwise") for name in ("fc1", "up_proj", "gate_proj", "w1", "w3", "c_fc", "mlp.0", "ffn.0")),
    *((name, "rowwise") for name in ("o_proj", "out_proj", "wo", "proj", "c_proj", "fc2", "down_proj", "w2",
                                     "mlp.2", "ffn.2")),
)
# Attributes of a module owning split attention projections that count its heads ...
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "num_key_value_heads", "n_kv_heads",
              "num_kv_heads", "n_kv_head", "kv_n_heads")
KV_HEAD_ATTRS = HEAD_ATTRS[4:]  # grouped-query attention's key-value heads
# ... and that hold its heads' total width (divided where the module has a head count too).
WIDTH_ATTRS = ("embed_dim", "hidden_size", "split_size", "all_head_size", "n_embd")


def matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def is_conv1d(module: nn.Module) -> bool:
    """HuggingFace's ``Conv1D`` (GPT-2's layers; transformers is not imported): a Linear whose weight is
    ``[in, out]``, the transpose of ``nn.Linear``'s."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and torch.is_tensor(weight) \
        and weight.dim() == 2


def output_dim(module: nn.Module) -> int:
    """The weight's dimension of the output features: 0 for ``nn.Linear`` (``[out, in]``), 1 for a Conv1D."""
    return 1 if is_conv1d(module) else 0


def features(module: nn.Module) -> tuple:
    """``(in, out)`` features of a Linear or Conv1D layer."""
    dim = output_dim(module)
    return module.weight.shape[1 - dim], module.weight.shape[dim]


def linear_modules(model: nn.Module) -> list:
    """The layers a plan may split: ``nn.Linear`` modules and HuggingFace's Conv1D (GPT-2)."""
    return [(name, m) for name, m in model.named_modules() if name and (isinstance(m, nn.Linear) or is_conv1d(m))]


def name_list(names: list, most: int = 12) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "") if names else "none"


def check_plan(plan) -> None:
    """A one-line error for a ``tensor.plan`` that is neither ``auto`` nor ``{pattern: style}``."""
    if isinstance(plan, str):
        if plan != "auto":
            raise DdpxError(f"config key 'tensor.plan' must be auto or a mapping {{pattern: style}} (styles: "
                            f"{', '.join(STYLES)}), got {plan!r}")
        return
    for pattern, style in dict(plan).items():
        if style not in STYLES:
            raise DdpxError(f"tensor.plan gives {pattern!r} the style {style!r}; a style is one of "
                            f"{', '.join(STYLES)}")


def resolve_plan(model: nn.Module, plan) -> tuple[dict, list]:
    """``({name: style}, unmatched)``: the style of each Linear module the plan splits (``none`` left
    out) and the names of the Linear modules it leaves whole. The user's patterns (``tensor.plan``
    a dict) come before :data:`AUTO_PLAN`; a pattern of the user's that matches no Linear module, or
    a plan that splits nothing, is a one-line error."""
    user = {} if plan == "auto" else dict(plan)
    linears = linear_modules(model)
    unused = [p for p in user if not any(matches(name, p) for name, _ in linears)]
    if unused:
        raise DdpxError(f"tensor.plan names {', '.join(map(repr, unused))}, which matches no nn.Linear module of "
                        f"{type(model).__name__} (its Linear modules: {name_list([n for n, _ in linears])})")
    chosen, builtin = {}, {}
    for name, _ in linears:
        style = next((s for p, s in user.items() if matches(name, p)), None)
        if style is not None:
            chosen[name] = style
            continue
        style = next((s for p, s in AUTO_PLAN if matches(name, p)), None)
        if style is not None:
            builtin[name] = style
    # a built-in match needs its partner beside it: a colwise/qkv and a rowwise layer under one parent
    by_parent: dict = {}
    for name, style in builtin.items():
        by_parent.setdefault(name.rpartition(".")[0], set()).add("rowwise" if style == "rowwise" else "colwise")
    for name, style in builtin.items():
        if by_parent[name.rpartition(".")[0]] == {"colwise", "rowwise"}:
            chosen[name] = style
    split = {name: style for name, style in chosen.items() if style != "none"}
    unmatched = [name for name, _ in linears if name not in split]
    if not split:
        raise DdpxError(
            f"tensor.plan={'auto' if plan == 'auto' else dict(plan)} splits none of {type(model).__name__}'s Linear "
            f"modules ({name_list([n for n, _ in linears])}); name them in tensor.plan, a colwise layer followed by a "
            "rowwise one, e.g. tensor.plan={\"*.up\": colwise, \"*.down\": rowwise} (qkv: a fused [q; k; v] "
            "projection), or use trainer.strategy=ddp or fsdp")
    return split, unmatched


def check_split(model: nn.Module, split: dict, size: int) -> list:
    """Refuse in one line what ``size`` does not divide (a split layer's features, a head count of a
    module owning split attention projections); returns ``[(module, attribute, value)]`` of the head
    counts and widths to divide by ``size``."""
    owners = {name.rpartition(".")[0] for name, style in split.items() if style != "rowwise"}
    changes = []
    for owner in sorted(owners):
        module = model.get_submodule(owner) if owner else model
        heads = [(a, getattr(module, a)) for a in HEAD_ATTRS if type(getattr(module, a, None)) is int]
        for attr, value in heads:
            if value % size:
                raise DdpxError(f"tensor.size={size} does not divide the {value} heads of {owner or 'the model'} "
                                f"({type(module).__name__}.{attr}): each rank computes whole heads; set tensor.size to "
                                f"a divisor of {value}")
        widths = [(a, getattr(module, a)) for a in WIDTH_ATTRS if type(getattr(module, a, None)) is int] \
            if heads else []
        for attr, value in widths:
            if value % size:
                raise DdpxError(f"tensor.size={size} does not divide {owner}.{attr}={value}; set tensor.size to a "
                                f"divisor of {value}")
        fused = [name for name, style in split.items() if style == "qkv" and name.rpartition(".")[0] == owner]
        counts = {value for attr, value in heads}
        if fused and len(counts) > 1:
            kv = next(f"{attr}={value}" for attr, value in heads if attr in KV_HEAD_ATTRS)
            raise DdpxError(f"{fused[0]} is split as a fused [q; k; v] of equal thirds (style qkv), but "
                            f"{owner or 'the model'} has grouped-query attention ({type(module).__name__}.{kv}, "
                            f"{max(counts)} query heads); leave it whole (tensor.plan={{{fused[0]}: none}} and its "
                            "output projection too), or project q, k and v apart and split them colwise")
        changes += [(module, attr, value) for attr, value in heads + widths]
    for name, style in split.items():
        layer = model.get_submodule(name)
        inputs, outputs = features(layer)
        features_, what = (inputs, "input features") if style == "rowwise" else (outputs, "output features")
        parts = 3 * size if style == "qkv" else size
        if features_ % parts:
            raise DdpxError(f"tensor.size={size} does not divide {name} ({style}, {features_} {what}"
                            f"{', 3 fused parts' if style == 'qkv' else ''}) evenly; set tensor.size to a divisor "
                            f"of {features_ // 3 if style == 'qkv' else features_}")
    return changes


