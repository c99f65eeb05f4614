"""The device benchmarks' weight-read floors, counted on the CPU: the hooks of `spec_e2e.weight_bytes_read`
and `decode_profile.bytes_by_kind` read a routed-experts call's arguments, so they break silently on the
GPU machine when the layer's call signature changes (as when the router's tensors became one `Routing`).

A routed-experts call reads only the experts its tokens are routed to: bytes = a module's own bytes ×
distinct experts / experts, computed here independently from the reference router."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_moe_expert_parallel import EXPERTS, HIDDEN, moe_config, one_rank

from hylo.layers import moe as moe_layer
from hylo.ops.moe import reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "device"))

import decode_profile
import spec_e2e


def own_bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for t in tensors)


def expected_bytes(moe, x: torch.Tensor) -> tuple[float, int]:
    """(Weight bytes of one `moe(x)`, distinct experts of its routed call)."""
    distinct = int(reference.route(x, moe.routing).ids.unique().numel())
    assert 0 < distinct < EXPERTS, "the check needs some experts read and some not"
    routed = own_bytes(moe.experts) * distinct / EXPERTS
    others = sum(own_bytes(m) for m in moe.modules() if m is not moe.experts)
    return routed + others, distinct


@pytest.fixture(params=[False, True], ids=["shared MLP", "shared folded"])
def fold(request, monkeypatch):
    """Whether the shared expert runs in the routed experts' launches (as at decode on the GPU; forced
    here): its MLP is then not called, and its bytes count with the experts call that reads them."""
    if request.param:
        monkeypatch.setattr(moe_layer.moe_ops, "shared_refusal", lambda *args: None)
    return request.param


def test_weight_bytes_read_counts_the_routed_experts_only(fold):
    moe = one_rank(moe_config())
    x = torch.randn(2, HIDDEN)
    expected, distinct = expected_bytes(moe, x)
    with torch.inference_mode():
        read, per_call = spec_e2e.weight_bytes_read([moe], lambda: moe(x))
    assert per_call == [distinct]
    assert read == expected


def test_bytes_by_kind_counts_the_routed_experts_only(fold):
    moe = one_rank(moe_config())
    x = torch.randn(2, HIDDEN)
    expected, _ = expected_bytes(moe, x)
    with torch.inference_mode():
        by_kind = decode_profile.bytes_by_kind(moe, lambda: moe(x))
    routed = own_bytes(moe.experts) * expected_bytes(moe, x)[1] / EXPERTS
    shared = sum(own_bytes(m) for m in moe.shared_experts.modules())
    assert sum(by_kind.values()) == expected
    experts_kind = by_kind[decode_profile.module_kind(moe.experts, "experts")]
    assert experts_kind == routed + (shared if fold else 0)


def test_bytes_by_kind_counts_a_drafts_modules_under_their_own_kinds():
    moe = one_rank(moe_config())
    draft = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN, bias=False))  # a verify step's drafter
    x = torch.randn(2, HIDDEN)
    expected, _ = expected_bytes(moe, x)
    with torch.inference_mode():
        by_kind = decode_profile.bytes_by_kind(moe, lambda: (moe(x), draft(x)), draft)
    assert by_kind.pop("draft " + decode_profile.OTHER) == own_bytes(draft[0])
    assert sum(by_kind.values()) == expected  # the target's kinds as without the draft
