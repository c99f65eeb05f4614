"""KDA's in-chunk launch in CUDA C++ (`ops/kda/intra_cuda.py`, `intra.cu`): it builds for sm_90a where nvcc is
(its C entry point taking the call structure as its ctypes mirror lays it out), and on a Hopper GPU it passes
its own check against the Triton launch and the whole prefill with it matches the fp32 reference within FLA's
bound (5e-3, as tests/test_kda_chunk_cuda.py's bf16 prefill)."""

from __future__ import annotations

import shutil

import pytest
import torch

from hylo.ops.kda import KDAInputs, KDAParams, KDASlots, intra_cuda, reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_the_launch_builds_for_hopper(tmp_path, monkeypatch):
    monkeypatch.setenv("HYLO_CACHE", str(tmp_path))
    intra_cuda.load_library.cache_clear()
    library = intra_cuda.load_library()
    intra_cuda.load_library.cache_clear()
    assert not isinstance(library, str), library
    assert library.hylo_kda_intra.argtypes[0]._type_ is intra_cuda.KdaIntraCall


@pytest.mark.skipif(not HOPPER, reason="the CUDA launch runs on a Hopper GPU")
def test_the_prefill_with_the_cuda_launch_matches_the_reference():
    from hylo.ops.kda import chunk  # here: a CPU run's interpreter tests must import the kernels first

    device = torch.device("cuda", torch.cuda.current_device())
    assert chunk.intra_cuda_refusal(device, 128, torch.bfloat16) is None
    gen = torch.Generator(device="cuda").manual_seed(3)
    heads, d = 8, 128
    hd = heads * d

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    lens = [1500, 1, 3, 2600]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = KDAInputs(*(randn(cu[-1], width, dtype=torch.bfloat16) for width in (hd, hd, hd, hd, heads)))
    params = KDAParams(randn(3 * hd, 4, scale=0.3), randn(hd, scale=0.5), randn(heads, scale=0.5), -5.0)
    conv_pool, state_pool = randn(8, 3, 3 * hd, dtype=torch.bfloat16), randn(8, heads, d, d, scale=0.05)
    slots = torch.tensor([5, 0, 7, 2], device="cuda")
    conv_ref, state_ref = conv_pool.clone(), state_pool.clone()
    o_ref = reference.prefill(x, params, KDASlots(conv_ref, state_ref, slots), None, cu)
    conv, state = conv_pool.clone(), state_pool.clone()
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    o = chunk.prefill(x, params, KDASlots(conv, state, slots), cu_dev, cu, intra_cuda=True)

    def err(a, b):
        a, b = a.double(), b.double()
        return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()

    assert torch.equal(conv, conv_ref)
    assert err(o, o_ref) < 5e-3 and err(state[slots], state_ref[slots]) < 5e-3
