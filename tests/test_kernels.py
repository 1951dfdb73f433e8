"""Fused kernels (ddpx.ops) against plain-torch reference implementations."""

import torch

from ddpx import ops


def test_int8_quantize_matches_reference_basic():
    x = torch.randn(1000)
    err = torch.zeros(1000)
    q, s = ops.int8_quantize(x, 64, err)
    v = torch.nn.functional.pad(x, (0, 24)).view(-1, 64)
    scale = v.abs().amax(1) / 127
    q_ref = torch.round(v / scale[:, None]).clamp(-127, 127)
    assert torch.equal(s, scale)
    assert torch.equal(q, q_ref.flatten()[:1000].to(torch.int8))
    assert torch.equal(err, (v - q_ref * scale[:, None]).flatten()[:1000])
