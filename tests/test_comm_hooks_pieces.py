"""Buckets larger than a hook's piece (DDP's default 25 MB buckets): int8, onebit
and powersgd code, send and decode a bucket piece by piece, pipelined. The
results must be bit-identical to the unsplit hook (piece_mb=0) and the native
path to the Python path, with piece boundaries that cut parameters (and, for
PowerSGD, run between matrices); error feedback must survive a state_dict()
round trip and DDP's bucket rebuild.
"""

import pytest
import torch

from comm_hook_checks import equal_lists, make_model, train

import ddpx.comm_hooks
from ddpx.errors import DdpxError

# The test_hooks Net: fc1.weight 4000, fc2.weight 40000, fc3.weight 2000 elements (+ biases);
# 0.03 MB pieces are 3932 elements per rank, rounded down to whole blocks / chunks: every
# piece boundary falls inside a parameter.
SMALL = 0.03
CASES = {
    # blocks of 256: fc1.weight is not whole blocks -> the packed path
    "int8": ("int8", {}),
    # blocks of 8: every weight is whole blocks -> coded straight from the bucket (spans)
    "int8_spans": ("int8", {"block_size": 8}),
    # blocks of 64 with biases: packed, odd sizes, exempt values only in the first piece
    "int8_all": ("int8", {"block_size": 64, "min_numel": 0, "compress_vectors": True}),
    # onebit and powersgd warm up by default: compress from the first step here
    "onebit": ("onebit", {"warmup_steps": 0}),  # weights only: packed or spans
    "onebit_all": ("onebit", {"min_numel": 0, "compress_vectors": True, "warmup_steps": 0}),  # contiguous
    "onebit_chunk32": ("onebit", {"chunk_size": 32, "warmup_steps": 0}),
    "powersgd": ("powersgd", {"warmup_steps": 0}),
}


def pieces_worker(rank, world):
    out = {}
    for label, (name, opts) in CASES.items():
        for piece_mb in (0.0, SMALL):
            for native in (False, True):
                r = train(name, native, rank=rank, steps=4, bucket_cap_mb=25, piece_mb=piece_mb, **opts)
                out[(label, piece_mb, native)] = r
    # state_dict round trip with pieces: save after step 2, resume, and compare
    for native in (False, True):
        full = train("int8", native, rank=rank, steps=6, bucket_cap_mb=25, piece_mb=SMALL)
        model_sd, opt_sd, hook_sd = full["saved"]
        net = make_model()
        net.load_state_dict(model_sd)
        resumed = train("int8", native, rank=rank, steps=3, first_step=3, model=net, state_sd=hook_sd,
                        opt_sd=opt_sd, bucket_cap_mb=25, piece_mb=SMALL)
        out[("roundtrip", native)] = (full["params"], resumed["params"])
    # DDP's defaults (first bucket 1 MB, then 25 MB) with a rebuild after step 1, several buckets
    for native in (False, True):
        out[("small_buckets", native)] = train("onebit", native, rank=rank, steps=4, bucket_cap_mb=0.05,
                                               piece_mb=0.01, warmup_steps=0)
    return out


@pytest.fixture(scope="module")
def pieces(ranks):
    return ranks.call(pieces_worker, 2, timeout=240)


@pytest.mark.parametrize("label", list(CASES))
def test_split_bucket_equals_unsplit_and_native_equals_python(pieces, label):
    r0, r1 = pieces
    ref = r0[(label, 0.0, False)]
    assert ref["pieces"] == [1], ref["pieces"]
    split = r0[(label, SMALL, False)]
    assert len(split["pieces"]) == 1 and split["pieces"][0] >= 2, split["pieces"]  # one bucket, several pieces
    for piece_mb in (0.0, SMALL):
        for native in (False, True):
            got = r0[(label, piece_mb, native)]
            assert got["native"] is native
            for step, (g, want) in enumerate(zip(got["grads"], ref["grads"])):
                assert equal_lists(g, want), (label, piece_mb, native, step)
            assert equal_lists(got["params"], ref["params"]), (label, piece_mb, native)
            assert equal_lists(got["params"], r1[(label, piece_mb, native)]["params"])  # replicas agree
            # the same bytes on the wire, counted the same way
            assert got["stats"]["wire_bytes"] == ref["stats"]["wire_bytes"], (label, piece_mb, native)
            assert got["stats"]["wire_bytes"] < 0.6 * got["stats"]["raw_bytes"]
    # and it learns the same thing the exact average does, roughly: not a no-op
    exact = r0[("int8", 0.0, False)]["grads"][0]
    assert not equal_lists(ref["grads"][0], [torch.zeros_like(g) for g in exact])


def test_state_dict_round_trip_with_pieces(pieces):
    for native in (False, True):
        full, resumed = pieces[0][("roundtrip", native)]
        assert equal_lists(full, resumed), native


def test_pieces_with_several_buckets_and_the_rebuild(pieces):
    py, nat = pieces[0][("small_buckets", False)], pieces[0][("small_buckets", True)]
    assert len(py["pieces"]) > 1 and max(py["pieces"]) > 1, py["pieces"]
    assert equal_lists(py["params"], nat["params"])
    assert equal_lists(py["params"], pieces[1][("small_buckets", False)]["params"])


def test_piece_option_validated():
    with pytest.raises(DdpxError, match="option piece_mb must be >= 0"):
        ddpx.comm_hooks.make("int8", piece_mb=-1)
    with pytest.raises(DdpxError, match="option piece_mb must be float"):
        ddpx.comm_hooks.make("onebit", piece_mb="4")
    state, _ = ddpx.comm_hooks.make("powersgd", piece_mb=2)
    assert state.opts["piece_mb"] == 2.0 and isinstance(state.opts["piece_mb"], float)


def test_piece_geometry():
    from ddpx.comm_hooks.twophase import piece_elements, piece_ranges, piece_spans

    assert piece_elements(0.0, 2, 256) == 0
    assert piece_elements(2.0, 2, 256) == 262144  # 2 MB of fp32 over 2 ranks
    assert piece_elements(0.001, 2, 256) == 256  # at least one unit
    assert piece_ranges(1000, 0) == [(0, 1000)]
    assert piece_ranges(1024, 256) == [(0, 256), (256, 256), (512, 256), (768, 256)]
    assert piece_ranges(1100, 512) == [(0, 512), (512, 512), (1024, 76)]
    # spans (rank, bucket offset, numel, segment offset) cut at segment offset 512
    spans = [(0, 0, 600, 0), (0, 600, 424, 600), (1, 1024, 1024, 0)]
    assert piece_spans(spans, 0, 512) == [(0, 0, 512, 0), (1, 1024, 512, 0)]
    assert piece_spans(spans, 512, 512) == [(0, 512, 88, 0), (0, 600, 424, 88), (1, 1536, 512, 0)]
