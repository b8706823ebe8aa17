"""``block_sparse_attention``: validates the call, builds the kept-tile lists once and dispatches to a backend.

Backends implement ``forward(q, k, v, layout, scale) -> (out, lse)`` and
``backward(q, k, v, out, lse, grad_out, layout, scale) -> (dq, dk, dv)``; the autograd wiring lives here
once for all of them. ``lse`` is the natural-log log-sum-exp of each query's allowed scores (fp32, fp64 for
fp64 inputs), -inf where nothing is allowed, head-major by token on every backend:
``lse.reshape(Hq, -1)[:, :T]`` is [Hq, T]. The backward uses ``out`` only through rowsum(out * grad_out),
which lets ring attention pass the merged output of all its steps.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch
from torch.autograd.function import once_differentiable

from . import attention_flex, launches
from .layout import PackedDocuments, TileLayout, as_packed_documents, check_attention_inputs

BACKENDS = ("auto", "torch", "triton", "flex")


# The oldest GPU architecture "auto" runs the Triton kernels on: below Ampere their tiles spill registers and
# overflow shared memory, and FlexAttention has no compiled kernels there either.
TRITON_MIN_CAPABILITY = (8, 0)


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" is triton on CUDA GPUs from Ampere on and torch otherwise; triton on CPU needs TRITON_INTERPRET=1 (on
    meta tensors nothing runs: ``cross_compile.compiling_for``); flex runs anywhere, but only forward on the CPU."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and _ampere_or_later(device) else "torch"
    if backend == "triton" and device.type == "meta" and not launches.compiling():
        raise ValueError("backend='triton' on meta tensors only compiles, inside cross_compile.compiling_for")
    if backend == "triton" and device.type not in ("cuda", "meta") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported")
    return backend


@torch.compiler.assume_constant_result  # read once when compiled, not traced
def _ampere_or_later(device: torch.device) -> bool:
    index = torch.cuda.current_device() if device.index is None else device.index
    return _capability(index) >= TRITON_MIN_CAPABILITY


@functools.cache  # a layer resolves its backend on every call
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _implementation(backend: str):
    module = {"torch": "attention_torch", "triton": "attention_triton"}[backend]
    return importlib.import_module(f".{module}", __package__)


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, scale, impl):
        out, lse = impl.forward(q, k, v, layout, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale, ctx.impl = layout, scale, impl
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.impl.backward(q, k, v, out, lse, grad_out, ctx.layout, ctx.scale)
        return dq, dk, dv, None, None, None


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | PackedDocuments,
    *,
    block_size: int,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over one packed stream where token i attends token j iff both are in the same document,
    j <= i and ``block_mask[h, i // B, j // B]``.

    q [T, Hq, D], k and v [T, Hkv, D] (query head h uses KV head h // (Hq / Hkv)); cu_seqlens int32
    [docs + 1] from 0 to T, or the stream's ``PackedDocuments`` (made once for all layers); block_mask bool
    [Hq, ceil(T/B), ceil(T/B)]; scale defaults to D ** -0.5.
    Returns [T, Hq, D] in q's dtype, differentiable in q, k and v. A query with no allowed key gets output 0
    and zero gradients. ``backend``: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (any device,
    cost proportional to the kept tiles), "flex" (PyTorch's FlexAttention, compiled on CUDA; forward only on the
    CPU), "auto" (triton on CUDA GPUs from Ampere on, torch otherwise).
    """
    check_attention_inputs(q, k, v, block_mask, block_size)
    documents = as_packed_documents(cu_seqlens, q.shape[0], block_size)
    backend = resolve_backend(backend, q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if backend != "flex" and torch.compiler.is_compiling():
        return _compiled_attention(q, k, v, block_mask, documents.cu_seqlens, block_size, scale, backend)[0]
    layout = TileLayout.build(block_mask, documents, q.shape[0], k.shape[1], block_size)
    if backend == "flex":  # its own autograd, which torch.compile traces
        return attention_flex.attend(q, k, v, layout, scale)
    return _BlockSparseAttention.apply(q, k, v, layout, scale, _implementation(backend))


# Under torch.compile the torch and Triton backends run as two custom ops, forward and backward, which it calls
# without tracing them (their host-side planning would break its graph); each builds the layout it needs. Their
# inputs are made contiguous, so that every output is, as their fakes say (inductor checks each output's strides).
@torch.library.custom_op(
    "sparsebalance::block_sparse_attention", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor block_mask, Tensor cu_seqlens, int block_size, float scale, "
           "str backend) -> (Tensor, Tensor)",
)
def _compiled_attention(q, k, v, block_mask, cu_seqlens, block_size, scale, backend):
    layout = TileLayout.build(block_mask, cu_seqlens, q.shape[0], k.shape[1], block_size)
    return _implementation(backend).forward(q.contiguous(), k.contiguous(), v.contiguous(), layout, scale)


@_compiled_attention.register_fake
def _(q, k, v, block_mask, cu_seqlens, block_size, scale, backend):
    return q.new_empty(q.shape), _implementation(backend).lse_like(q, block_mask.shape[1], block_size)


@torch.library.custom_op(
    "sparsebalance::block_sparse_attention_backward", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor grad_out, Tensor block_mask, "
           "Tensor cu_seqlens, int block_size, float scale, str backend) -> (Tensor, Tensor, Tensor)",
)
def _compiled_attention_backward(q, k, v, out, lse, grad_out, block_mask, cu_seqlens, block_size, scale, backend):
    layout = TileLayout.build(block_mask, cu_seqlens, q.shape[0], k.shape[1], block_size)
    q, k, v, out, grad_out = (x.contiguous() for x in (q, k, v, out, grad_out))
    dq, dk, dv = _implementation(backend).backward(q, k, v, out, lse, grad_out, layout, scale)
    # A custom op's outputs may not share memory, and the Triton backend's dK and dV are halves of one tensor.
    shared = dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr()
    return dq, dk, dv.clone() if shared else dv


@_compiled_attention_backward.register_fake
def _(q, k, v, out, lse, grad_out, block_mask, cu_seqlens, block_size, scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_backward(ctx, inputs, output) -> None:
    q, k, v, block_mask, cu_seqlens, ctx.block_size, ctx.scale, ctx.backend = inputs
    ctx.save_for_backward(q, k, v, *output, block_mask, cu_seqlens)


def _backward_of_compiled(ctx, grad_out, grad_lse):
    q, k, v, out, lse, block_mask, cu_seqlens = ctx.saved_tensors
    grads = _compiled_attention_backward(q, k, v, out, lse, grad_out, block_mask, cu_seqlens, ctx.block_size,
                                         ctx.scale, ctx.backend)
    return *grads, None, None, None, None, None


_compiled_attention.register_autograd(_backward_of_compiled, setup_context=_save_for_backward)
