"""The ddpx.comm_hooks API, in this process: the hook names and the native algorithms
behind them, options and their one-line errors, DDP options, and what ``register``
says when it falls back to the Python hook or has nothing to compress."""

import logging

import pytest
import torch

import ddpx.comm_hooks
import ddpx.optim
from ddpx.errors import DdpxError
from ddpx.rank import process_group


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


@pytest.mark.parametrize("name, options, said", [
    ("onebit_adam", {}, "2 of 5 parameters compressed (98.9% of the elements; min_numel=16384 leaves 1 small tensor in "
                        "fp32; 2 vectors (biases, norms) in fp32, compress_vectors=false)"),
    ("int8", {}, "2 of 5 parameters compressed (98.9% of the elements; min_numel=1024 leaves 1 small tensor in fp32; "
                 "2 vectors (biases, norms) in fp32, compress_vectors=false)"),
    ("powersgd", {"min_numel": 0}, "3 of 5 parameters compressed (99.7% of the elements; 2 vectors (biases, norms) in "
                                   "fp32)"),
    ("fp16", {"compress_vectors": True, "min_numel": 0}, "5 of 5 parameters compressed (all of the elements)"),
    ("allreduce", {}, None),
])
def test_the_compression_coverage_says_what_min_numel_leaves_in_fp32(name, options, said):
    """A small model's matrices under min_numel travel in fp32: onebit_adam sent 1/1.52 of fp32's
    bytes instead of 1/18, and nothing said so; ``ddpx train`` now says it at install."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64, bias=False),
                                torch.nn.Linear(64, 10))  # 65536 + 16384 (two matrices >= 16384) + 640 + 2 biases
    state = ddpx.comm_hooks.make_state(name, **options)
    assert ddpx.comm_hooks.compression_coverage(model, state) == said


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
    from ddpx.comm_hooks import halfprec, registry

    monkeypatch.setattr(registry, "_METHODS", None)  # found again, then restored
    monkeypatch.setattr(halfprec, "METHODS", (*halfprec.METHODS, halfprec.METHODS[0]))
    with pytest.raises(DdpxError, match="comm hook 'fp16' is declared twice: Fp16State and Fp16State"):
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
    (lambda kinds: [k for k in kinds if k != "int8"], "named by a method but not built: int8"),
    (lambda kinds: kinds + ["int4"], "built but named by no method: int4"),
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


# ------------------------------------------------ one descriptor per method, one registry
def test_the_registry_lists_each_method_once_with_its_parts():
    from ddpx.comm_hooks import halfprec, int8, onebit, onebit_adam, powersgd, reduce_scatter
    from ddpx.comm_hooks.state import HookState

    methods = ddpx.comm_hooks.methods()
    names = [m.name for m in methods]
    assert names == sorted(set(names)) == ["allreduce", "bf16", "fp16", "int8", "onebit", "onebit_adam", "powersgd"]
    parts = {m.name: (m.state, m.native, m.native_stage2, m.sharded, m.sharded_options, m.optimizer, m.ddp_options())
             for m in methods}
    views = {"gradient_as_bucket_view": True}
    assert parts["int8"] == (int8.Int8State, "int8", None, int8.Int8ReduceScatter, ("block_size", "scope"), None,
                             {**views, "bucket_cap_mb": 4.0})
    assert parts["fp16"] == (halfprec.Fp16State, "cast", "cast_phases", halfprec.Fp16ReduceScatter, ("scope",), None,
                             views)
    assert parts["bf16"][:4] == (halfprec.Bf16State, "cast", "cast_phases", halfprec.Bf16ReduceScatter)
    assert parts["onebit"] == (onebit.OnebitState, "onebit", None, None, (), None, views)
    assert parts["onebit_adam"] == (onebit_adam.OneBitAdamState, None, None, None, (), "ddpx.optim.OneBitAdam", views)
    assert parts["powersgd"][:4] == (powersgd.PowerSGDState, "powersgd", None, None)
    for m in methods:
        assert ddpx.comm_hooks.method(m.name) is m
        assert issubclass(m.state, HookState)
        assert m.sharded is None or issubclass(m.sharded, reduce_scatter.CompressedReduceScatter)
        state = m.make_state()
        assert state.method is m and state.name == m.name and isinstance(state, ddpx.comm_hooks.CommState)
        assert state.opts == m.check_options({})  # the one dict of options, with its defaults
    assert ddpx.comm_hooks.method_for_optimizer(ddpx.optim.OneBitAdam).name == "onebit_adam"
    assert ddpx.comm_hooks.method_for_optimizer(torch.optim.AdamW) is None
    with pytest.raises(DdpxError, match=r"^unknown comm hook 'int4'; available: allreduce, bf16, fp16, int8, onebit, "
                                        r"powersgd$"):
        ddpx.comm_hooks.method("int4")


def test_the_sharded_form_takes_the_methods_options_and_is_a_comm_state():
    comm = ddpx.comm_hooks.method("int8").make_sharded(block_size=128)
    assert isinstance(comm, ddpx.comm_hooks.CommState) and comm.name == "int8" and comm.block_size == 128
    assert comm.state_dict() is None  # nothing to checkpoint
    with pytest.raises(DdpxError, match=r"^comm hook 'powersgd' has no reduce-scatter for trainer.strategy=fsdp; "
                                        r"choose one of: bf16, fp16, int8$"):
        ddpx.comm_hooks.method("powersgd").make_sharded()


def adamw():
    return torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])


def sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)


def test_pairing_resolves_the_auto_options_before_the_first_bucket():
    """What the comm_hook plugin does at train start: with AdamW int8 codes its first bucket
    in blocks of 64 and powersgd approximates at rank 16; with SGD 256 and 4; an explicit
    option stays."""
    int8, powersgd = ddpx.comm_hooks.make_state("int8"), ddpx.comm_hooks.make_state("powersgd")
    assert (int8.block_size, powersgd.approx_rank) == (256, 4)  # not paired yet
    for state in (int8, powersgd):
        state.pair(adamw())
    assert (int8.block_size, powersgd.approx_rank) == (64, 16)
    int8, powersgd = ddpx.comm_hooks.make_state("int8"), ddpx.comm_hooks.make_state("powersgd")
    for state in (int8, powersgd):
        state.pair(sgd())
    assert (int8.block_size, powersgd.approx_rank) == (256, 4)
    fixed = ddpx.comm_hooks.make_state("int8", block_size=128)
    fixed.pair(adamw())
    assert fixed.block_size == 128
    assert ddpx.comm_hooks.make_state("powersgd", rank=8).approx_rank == 8


def test_a_resumed_state_keeps_its_auto_values():
    """A loaded state dict wins over pairing (the plugin pairs after the checkpoint's restore):
    the memory was built with those values. Pairing it otherwise says so, once."""
    adam_int8, adam_powersgd = ddpx.comm_hooks.make_state("int8"), ddpx.comm_hooks.make_state("powersgd")
    for state in (adam_int8, adam_powersgd):
        state.pair(adamw())
    resumed = ddpx.comm_hooks.make_state("powersgd")
    resumed.load_state_dict(adam_powersgd.state_dict())
    resumed.pair(adamw())
    assert resumed.approx_rank == 16
    resumed = ddpx.comm_hooks.make_state("int8")
    resumed.load_state_dict(adam_int8.state_dict())
    assert resumed.block_size == 64


@pytest.fixture
def one_rank(tmp_path):
    """A process group of this process alone (gloo), torn down after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    process_group.teardown()


def plain_script(name, pair_with=None, **options):
    """What a plain DDP script does: ``DDP(model)``, ``register``, (pair,) two steps. Returns the
    state, closed, and the block sizes (int8) or ranks (powersgd) its layouts were built with."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    state = ddpx.comm_hooks.register(ddp, name, **options)
    opt = (pair_with or torch.optim.SGD)(ddp.parameters(), lr=0.01)
    if pair_with is not None:
        state.pair(opt)
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.randn(8, 64)).sum().backward()
        opt.step()
    state.close()
    used = sorted({pc.block for lay in state.layouts.values() for pc in lay.pieces} if name == "int8" else
                  {r for lay in state.layouts.values() for r in lay.matrices[:, 4].tolist()})
    return state, used


@pytest.mark.parametrize("name, option, value, adam", [("int8", "block_size", 256, 64), ("powersgd", "rank", 4, 16)])
def test_a_plain_script_that_never_pairs_gets_the_sgd_value_and_one_line(one_rank, caplog, name, option, value, adam):
    """A plain DDP script that registers the hook and never pairs it: the first bucket fixes
    the value without an Adam-family optimizer, and one line says how to pair."""
    with caplog.at_level(logging.WARNING, logger="ddpx.comm_hooks"):
        state, used = plain_script(name, warmup_steps=0, min_numel=0)
    assert state.native and used == [value] and state.option(option) == value
    said = [r.getMessage() for r in caplog.records if "pair" in r.getMessage()]
    assert said == [f"comm hook {name!r}: {option} auto is {value} ({adam} with an Adam-family optimizer): no "
                    "optimizer was paired with it before its first step; call state.pair(optimizer) before "
                    "training (docs/comm_hooks.md)"]


@pytest.mark.parametrize("name, value", [("int8", 64), ("powersgd", 16)])
def test_a_plain_script_paired_with_adamw_codes_its_first_bucket_so(one_rank, caplog, name, value):
    with caplog.at_level(logging.WARNING, logger="ddpx.comm_hooks"):
        state, used = plain_script(name, pair_with=torch.optim.AdamW, warmup_steps=0, min_numel=0)
    assert used == [value]
    assert not [r for r in caplog.records if "pair" in r.getMessage()]


def test_a_late_pairing_keeps_the_value_in_use_and_says_so_once(one_rank, caplog):
    state, used = plain_script("int8", warmup_steps=0)  # two steps coded at 256: the pairing comes too late
    with caplog.at_level(logging.WARNING, logger="ddpx.comm_hooks"):
        for _ in range(2):
            state.pair(adamw())
    assert used == [256] and state.block_size == 256
    late = [r.getMessage() for r in caplog.records if "auto stays" in r.getMessage()]
    assert late == ["comm hook 'int8': block_size auto stays 256 (not paired before its first use); pairing with "
                    "AdamW would make it 64, but a value once chosen stays: pair once, before the first step"]


def test_no_process_wide_optimizer_hook():
    """Pairing is explicit: nothing in ddpx registers a hook on every optimizer of the process."""
    import pathlib

    root = pathlib.Path(ddpx.__file__).parent
    found = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if "register_optimizer_step_pre_hook" in p.read_text() or "register_optimizer_step_post_hook" in
             p.read_text()]
    assert found == []
