"""The ddpx.comm_hooks API, in this process: the hook names and the native algorithms
behind them, options and their one-line errors, DDP options, and what ``register``
says when it falls back to the Python hook or has nothing to compress."""

import logging

import pytest
import torch

import ddpx.comm_hooks
from ddpx.errors import DdpxError


def test_available_names():
    assert {"allreduce", "fp16", "bf16", "int8"} <= set(ddpx.comm_hooks.available())


def test_without_warmup_makes_a_hook_compress_from_its_first_step():
    assert ddpx.comm_hooks.without_warmup("onebit") == {"warmup_steps": 0}
    assert ddpx.comm_hooks.make("powersgd", **ddpx.comm_hooks.without_warmup("powersgd"))[0].warming_up() is False
    assert ddpx.comm_hooks.without_warmup("allreduce") == {}  # it has no warm-up
    with pytest.raises(DdpxError, match="unknown comm hook 'nope'"):
        ddpx.comm_hooks.without_warmup("nope")


def test_the_package_gives_comm_hooks_as_an_attribute():
    import importlib

    # the package's __getattr__ answers for a submodule not imported yet: `import ddpx; ddpx.comm_hooks`
    for name in ("comm_hooks", "fused_allreduce", "ops", "data", "models", "config"):
        assert ddpx.__getattr__(name) is importlib.import_module(f"ddpx.{name}")
    with pytest.raises(AttributeError):
        ddpx.__getattr__("hooks")  # "hooks" are the plugin hooks; the comm hooks are ddpx.comm_hooks


def test_ddp_options_per_hook():
    # int8: the wire starts a layer into the backward pass; every hook writes into the
    # bucket, so DDP's copy of the bucket back into .grad is skipped
    assert ddpx.comm_hooks.ddp_options("int8") == {"gradient_as_bucket_view": True, "bucket_cap_mb": 4.0}
    for name in ("fp16", "allreduce", "onebit", "powersgd"):
        assert ddpx.comm_hooks.ddp_options(name) == {"gradient_as_bucket_view": True}
    with pytest.raises(DdpxError, match="unknown comm hook 'int9'; available: "):
        ddpx.comm_hooks.ddp_options("int9")


@pytest.mark.parametrize(
    "name,opts,needle",
    [
        ("int9", {}, "unknown comm hook 'int9'; available: "),
        ("int8", {"blocksize": 64}, "unknown option(s) blocksize; known options: block_size"),
        ("int8", {"block_size": 30}, "block_size must be 'auto' or a positive multiple of 4, got 30"),
        ("fp16", {"warmup_steps": -1}, "warmup_steps must be >= 0"),
        ("fp16", {"compress_vectors": 1}, "compress_vectors must be bool, got 1"),
        ("allreduce", {"min_numel": 5}, "unknown option(s) min_numel; known options: none"),
    ],
)
def test_bad_options_are_one_line_errors(name, opts, needle):
    with pytest.raises(DdpxError) as info:
        ddpx.comm_hooks.make(name, **opts)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_options_validated():
    with pytest.raises(ddpx.DdpxError, match="rank must be 'auto' or an int >= 1, got 0"):
        ddpx.comm_hooks.make("powersgd", rank=0)
    with pytest.raises(ddpx.DdpxError, match="rank must be 'auto' or an int >= 1, got 4.0"):
        ddpx.comm_hooks.make("powersgd", rank=4.0)
    with pytest.raises(ddpx.DdpxError, match="chunk_size must be a positive multiple of 8"):
        ddpx.comm_hooks.make("onebit", chunk_size=12)
    with pytest.raises(ddpx.DdpxError, match="unknown option"):
        ddpx.comm_hooks.make("powersgd", compress_vectors=True)
    state, _ = ddpx.comm_hooks.make("powersgd", rank=2)
    assert state.approx_rank == 2 and state.opts["rank"] == 2


class NoReducer(torch.nn.Module):
    process_group = None

    def register_comm_hook(self, state, hook):
        self.registered = (state, hook)


def test_register_falls_back_to_python_and_says_why(caplog):
    model = NoReducer()
    with caplog.at_level(logging.WARNING, logger="ddpx.comm_hooks"):
        state = ddpx.comm_hooks.register(model, "fp16")
    assert model.registered == (state, ddpx.comm_hooks.hook) and state.native is False
    assert "using the Python hook: NoReducer has no DDP reducer" in caplog.text


@pytest.mark.parametrize("name,options,warned", [("onebit", {}, True), ("onebit", {"min_numel": 1024}, False),
                                                  ("int8", {}, False), ("fp16", {}, False)])
def test_register_says_when_no_parameter_would_be_compressed(caplog, name, options, warned):
    """onebit's default min_numel (16384) exempts every matrix of a 64 x 128 MLP."""
    class SmallDDP(torch.nn.Module):
        process_group = None

        def __init__(self):
            super().__init__()
            self.module = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 10))

        def register_comm_hook(self, state, hook):
            pass

    with caplog.at_level(logging.WARNING, logger="ddpx.comm_hooks"):
        ddpx.comm_hooks.register(SmallDDP(), name, native=False, **options)
    said = "no parameter of this model is compressed (the largest has 8192 elements, min_numel is 16384)"
    assert (said in caplog.text) is warned, caplog.text


WARMUP_OPTION = "(option warmup_steps; comm_hook.options.warmup_steps in a ddpx config)"


@pytest.mark.parametrize("name, options, said", [
    ("powersgd", {}, "exact fp32 allreduce for the first 100 steps, compressing from step 100"),
    ("onebit", {}, "exact fp32 allreduce for the first 100 steps, compressing from step 100"),
    ("onebit_adam", {}, "exact allreduce and AdamW steps for the first 100 steps; from step 100 Adam's second "
                        "moment is frozen and the updates travel 1-bit"),
    ("int8", {"warmup_steps": 5}, "exact fp32 allreduce for the first 5 steps, compressing from step 5"),
    ("int8", {}, None),
    ("powersgd", {"warmup_steps": 0}, None),
])
def test_a_hook_that_warms_up_says_when_compression_starts(caplog, name, options, said):
    """With defaults, onebit and powersgd send plain allreduce for 100 steps: a short trial
    showed no compression at all. register() and make() say so, once each."""
    for make in (lambda: ddpx.comm_hooks.register(NoReducer(), name, native=False, **options),
                 lambda: ddpx.comm_hooks.make(name, **options)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ddpx.comm_hooks"):
            make()
        notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"comm hook {name}: ")]
        assert notes == ([f"comm hook {name}: {said} {WARMUP_OPTION}"] if said else [])


# ------------------------------ the hook names, and the native algorithms behind them
def test_a_hook_name_given_twice_is_refused(monkeypatch):
    from ddpx.comm_hooks import halfprec

    monkeypatch.setattr(ddpx.comm_hooks, "_REGISTRY", None)  # built again, then restored
    monkeypatch.setattr(halfprec, "HOOKS", (*halfprec.HOOKS, halfprec.Fp16State))
    with pytest.raises(DdpxError, match="comm hook 'fp16' is defined twice: Fp16State and Fp16State"):
        ddpx.comm_hooks.available()


def built_kinds() -> list:
    from ddpx import _C

    if not getattr(_C, "has_native_hooks", False):
        pytest.skip("this ddpx._C build has no native comm hooks")
    return list(_C.native_hook_kinds())


def test_each_native_kind_the_states_name_is_built_once_and_no_other():
    built = built_kinds()
    assert sorted(built) == sorted(ddpx.comm_hooks.native_kinds())
    assert {"cast", "cast_phases", "int8", "inter_node"} <= set(built)  # fp16/bf16, their stage 2, the scope's
    ddpx.comm_hooks.check_native_kinds(built)


@pytest.mark.parametrize("change,needle", [
    (lambda kinds: [k for k in kinds if k != "int8"], "named by a Python state but not built: int8"),
    (lambda kinds: kinds + ["int4"], "built but named by no Python state: int4"),
    (lambda kinds: kinds + ["cast"], "registered more than once: cast"),
], ids=["missing", "extra", "twice"])
def test_register_refuses_an_extension_whose_kinds_differ(monkeypatch, change, needle):
    """Not a fallback to the Python hook: a stale build is an error, whichever hook asks first."""
    from ddpx import _C

    monkeypatch.setattr(_C, "native_hook_kinds", lambda kinds=change(built_kinds()): kinds)
    model = NoReducer()
    with pytest.raises(DdpxError) as info:
        ddpx.comm_hooks.register(model, "fp16")
    assert needle in str(info.value) and "rebuild the extension (pip install -e .)" in str(info.value)
    assert not hasattr(model, "registered")


def _step(optimizer_class, **kwargs):
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    optimizer_class([w], **kwargs).step()


def test_powersgd_rank_auto_follows_the_first_optimizer_step():
    adam, sgd, fixed = (ddpx.comm_hooks.make_state("powersgd") for _ in range(3))
    fixed._fix_rank()  # what the first compressed layout does: before any optimizer step, rank 4 for good
    assert adam.approx_rank == sgd.approx_rank == 4  # until an optimizer steps
    _step(torch.optim.AdamW)
    assert adam.approx_rank == 16 and fixed.approx_rank == 4
    sgd = ddpx.comm_hooks.make_state("powersgd")
    _step(torch.optim.SGD, lr=0.1)
    assert sgd.approx_rank == 4
    assert ddpx.comm_hooks.make_state("powersgd", rank=8).approx_rank == 8
    resumed = ddpx.comm_hooks.make_state("powersgd")
    resumed.load_state_dict(adam.state_dict())  # a resumed run keeps the rank its memory was built with
    assert resumed.approx_rank == 16
