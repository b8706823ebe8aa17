"""block_sparse_attention (torch and Triton backends) against the dense fp64 reference.

Triton runs compiled on CUDA tensors where a GPU exists and under the interpreter on CPU otherwise.
"""

import functools
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from attention_cases import TRITON_OK, check_against_reference, device_for, packed_case, relative_error
from main_runner import REPO

from sparsebalance_pl.kernels import (
    LayerBudget, PackedDocuments, block_sparse_attention, reference_block_sparse_attention, select_with_budget,
)
from sparsebalance_pl.kernels import attention
from sparsebalance_pl.kernels.attention import _implementation, resolve_backend
from sparsebalance_pl.kernels.layout import TileLayout, pair_mask, token_doc_ids

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 2), (7, 1)])
@pytest.mark.parametrize("seed", range(5))
def test_matches_reference_fp32(backend, q_heads, kv_heads, seed):
    num_tokens = 150 if backend == "torch" else 72
    case = packed_case(seed, num_tokens, q_heads, kv_heads, 16, 16, device=device_for(backend))
    check_against_reference(backend, *case, block_size=16, seed=seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (128, 16), (256, 64)])  # 256: four 16-row fp32 tiles a block
def test_head_dims_64_128_and_256(backend, head_dim, block_size):
    case = packed_case(11, 80, 2, 1, head_dim, block_size, device=device_for(backend))
    check_against_reference(backend, *case, block_size=block_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    """Callers pass transposed views of [H, T, D] tensors (the transformers attention interface)."""
    q, k, v, mask, cu = packed_case(9, 70, 4, 2, 16, 16, device=device_for(backend))
    q, k, v = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))
    assert not q.is_contiguous()
    check_against_reference(backend, q, k, v, mask, cu, block_size=16)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("always_kept", [True, False])
def test_torch_backend_many_chunks_and_workers(monkeypatch, threads, always_kept):
    """Scattered masks cut into many chunks of different widths, shared by one or two worker threads (the
    benchmark sizes' code paths on a small case): gradients accumulated across chunks and workers stay
    exact, and the caller's thread count is restored."""
    from sparsebalance_pl.kernels import attention_torch

    monkeypatch.setattr(attention_torch, "_CHUNK_ELEMENTS", 1 << 11)
    case = packed_case(12, 400, 4, 2, 16, 16, keep=0.3, always_kept=always_kept)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_against_reference("torch", *case, block_size=16)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(previous)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_backend_on_a_gpu_queues_its_chunks_on_the_callers_stream(monkeypatch):
    """On a device the chunks run on the calling thread, whatever the CPU threads: a worker thread would queue them
    on the device's default stream, racing the caller's."""
    from sparsebalance_pl.kernels import attention_torch

    monkeypatch.setattr(attention_torch, "_CHUNK_ELEMENTS", 1 << 11)
    case = packed_case(12, 400, 4, 2, 16, 16, keep=0.3, device="cuda")
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            check_against_reference("torch", *case, block_size=16)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_mask_is_causal_attention_within_documents(backend):
    q, k, v, mask, cu = packed_case(3, 90, 4, 2, 16, 16, device=device_for(backend))
    mask = torch.ones_like(mask)
    out = block_sparse_attention(q, k, v, mask, cu, block_size=16, backend=backend)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qd, kd, vd = (x[start:end].double().transpose(0, 1) for x in (q, k, v))
        exact = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True).transpose(0, 1)
        assert relative_error(out[start:end], exact) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_allowed_keys_give_zero_not_nan(backend):
    q, k, v, mask, cu = packed_case(5, 64, 2, 1, 16, 16, keep=0.3, always_kept=False, device=device_for(backend))
    mask[0, 2, :] = False  # every query of block 2, head 0, sees nothing
    check_against_reference(backend, q, k, v, mask, cu, block_size=16)
    q.requires_grad_()
    out = block_sparse_attention(q, k, v, mask, cu, block_size=16, backend=backend)
    assert torch.all(out[32:48, 0] == 0)
    (grad_q,) = torch.autograd.grad(out.sum(), q)
    assert torch.all(grad_q[32:48, 0] == 0)



@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_mask_gives_zero_output_and_gradients(backend):
    q, k, v, mask, cu = packed_case(6, 100, 2, 1, 16, 16, always_kept=False, device=device_for(backend))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = block_sparse_attention(q, k, v, torch.zeros_like(mask), cu, block_size=16, backend=backend)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.all(out == 0) and all(torch.all(g == 0) for g in grads)

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,head_dim,block_size", [(64, 16, 16), (160, 256, 64)])  # 256: 32-row tiles
def test_half_precision_inputs(backend, dtype, num_tokens, head_dim, block_size):
    q, k, v, mask, cu = packed_case(7, num_tokens, 4, 2, head_dim, block_size, device=device_for(backend))
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    out = block_sparse_attention(q, k, v, mask, cu, block_size=block_size, backend=backend)
    ref = reference_block_sparse_attention(q, k, v, mask, cu, block_size=block_size)
    assert out.dtype == dtype
    assert relative_error(out, ref) <= 2e-2
    out.float().sum().backward()
    assert all(x.grad.dtype == dtype and torch.isfinite(x.grad).all() for x in (q, k, v))


def reference_lse(q, k, mask, cu, block_size, scale):
    """fp64 logsumexp over each query's allowed keys, [Hq, T] (-inf where nothing is allowed)."""
    num_tokens, num_q_heads, _ = q.shape
    allowed = pair_mask(token_doc_ids(cu, num_tokens), torch.arange(num_tokens), block_size, mask)
    kd = k.double().repeat_interleave(num_q_heads // k.shape[1], dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kd.transpose(1, 2) * scale
    return scores.masked_fill(~allowed, float("-inf")).logsumexp(dim=-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_tokens", [64, 75])  # whole blocks, and a partial last block
def test_forward_lse_is_natural_log(backend, num_tokens):
    """Every backend's forward returns the natural-log lse of each query's allowed scores (what ring
    attention merges partial results with), -inf where nothing is allowed."""
    q, k, v, mask, cu = packed_case(4, num_tokens, 4, 2, 16, 16, keep=0.4, always_kept=False)
    mask[1, 2] = False  # head 1, query block 2 sees nothing
    scale = 16**-0.5
    want = reference_lse(q, k, mask, cu, 16, scale)
    device = device_for(backend)
    q, k, v, mask, cu = (x.to(device) for x in (q, k, v, mask, cu))
    layout = TileLayout.build(mask, cu, num_tokens, k.shape[1], 16)
    _, lse = _implementation(backend).forward(q, k, v, layout, scale)
    got = lse.reshape(q.shape[1], -1)[:, :num_tokens].cpu()  # the layout every backend shares
    empty = torch.isneginf(want)
    assert empty[1, 32:48].all()
    assert torch.equal(torch.isneginf(got), empty)
    torch.testing.assert_close(got[~empty].double(), want[~empty], rtol=1e-6, atol=1e-5)


def test_invalid_arguments_raise_clear_errors():
    q, k, v, mask, cu = packed_case(0, 64, 2, 1, 16, 16)
    call = block_sparse_attention
    with pytest.raises(ValueError, match="power of two"):
        call(q, k, v, mask, cu, block_size=24)
    with pytest.raises(ValueError, match="auto, torch, triton"):
        call(q, k, v, mask, cu, block_size=16, backend="cuda")
    with pytest.raises(ValueError, match="block_mask"):
        call(q, k, v, mask[:, :-1], cu, block_size=16)
    with pytest.raises(ValueError, match="multiple"):
        call(q, torch.randn(64, 3, 16), torch.randn(64, 3, 16), mask, cu, block_size=16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(q, k, v, mask, cu.long(), block_size=16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(q, k, v, mask, torch.tensor([0, 70], dtype=torch.int32), block_size=16)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        call(q[0], k, v, mask, cu, block_size=16)


@pytest.mark.parametrize(("capability", "expected"), [((7, 5), "torch"), ((8, 0), "triton"), ((9, 0), "triton")])
def test_auto_runs_triton_on_gpus_from_ampere_on(monkeypatch, capability, expected):
    """Below Ampere (a T4) the Triton kernels spill and overflow shared memory: "auto" takes the torch kernels."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(attention, "_capability", functools.cache(attention._capability.__wrapped__))
    assert resolve_backend("auto", torch.device("cuda", 0)) == expected
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("triton", torch.device("cuda", 0)) == "triton"  # asked for by name: as asked


@pytest.mark.parametrize("backend", BACKENDS)
def test_layers_sharing_packed_documents_select_and_attend_as_from_cu_seqlens(backend):
    q, k, v, _, cu = packed_case(3, 75, 4, 2, 16, 16, device=device_for(backend))
    documents = PackedDocuments(cu, 75, 16)
    results = []
    for bounds in (cu, documents, documents):  # the second layer reuses what the first derived
        selection = select_with_budget(q, k, bounds, LayerBudget(0.8), LayerBudget(0.9), block_size=16, stride=8,
                                       backend=backend)
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = block_sparse_attention(qg, kg, vg, selection.mask, bounds, block_size=16, backend=backend)
        out.sum().backward()
        results.append((selection.mask, selection.base_document_density, out, qg.grad, kg.grad, vg.grad))
    for shared in results[1:]:
        for x, y in zip(results[0], shared):
            assert torch.equal(x, y)


def test_packed_documents_of_another_stream_are_refused():
    q, k, v, mask, cu = packed_case(0, 64, 2, 1, 16, 16)
    with pytest.raises(ValueError, match="packed documents are of 64 tokens in blocks of 32, the call's of 64 in "
                                         "blocks of 16"):
        block_sparse_attention(q, k, v, mask, PackedDocuments(cu, 64, 32), block_size=16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        PackedDocuments(cu, 70, 16)


def test_package_import_is_light():
    code = "import sys, sparsebalance_pl.kernels; print('torch' in sys.modules, 'triton' in sys.modules)"
    root = REPO
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["False", "False"], result.stderr
