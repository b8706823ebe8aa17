"""One layer's sparse attention (selection, then block-sparse attention) under torch.compile: no graph break, the
compiled layer equals the eager one, and new budgets or stream lengths do not compile it again, on the torch
backend and on the device path (Triton: on a GPU, or here through Triton's interpreter); the same for the compiled
FlexAttention the flex backend runs on CUDA."""

import warnings

import pytest
import torch
from attention_cases import TRITON_OK
from functorch.compile import aot_module_simplified, make_boxed_func
from torch.nn.attention.flex_attention import flex_attention

from sparsebalance_pl.kernels import LayerBudget, block_sparse_attention, select_with_budget
from sparsebalance_pl.kernels.attention_flex import block_mask
from sparsebalance_pl.kernels.layout import TileLayout

BASE = LayerBudget(0.9)


def layer(q, k, v, cu_seqlens, budget, backend="torch"):
    selection = select_with_budget(q.detach(), k.detach(), cu_seqlens, budget, BASE, block_size=16, stride=8,
                                   backend=backend)
    out = block_sparse_attention(q, k, v, selection.mask, cu_seqlens, block_size=16, backend=backend)
    return out, selection.stats.mean_density(), selection.base_document_density


def stream(num_tokens, docs, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(num_tokens, h, 16, generator=gen).to(device).requires_grad_() for h in (4, 2, 2))
    return q, k, v, torch.linspace(0, num_tokens, docs + 1).round().int().to(device)


NEEDS_TRITON = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
BACKENDS = ["torch", pytest.param("triton", marks=NEEDS_TRITON)]


def device_of(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given and runs them through AOT autograd, as inductor does
    (which is where a number that cannot stay symbolic is specialised), without compiling them."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return aot_module_simplified(graph, example_inputs,
                                     fw_compiler=lambda traced, _: make_boxed_func(traced.forward))


TUNED = LayerBudget(0.95, 0.6, 0.7)


@pytest.mark.parametrize("budget", [BASE, TUNED], ids=["base", "tuned"])
def test_no_graph_break_and_the_compiled_layer_equals_the_eager_one(budget):
    """The torch backend; the device path compiles whole in ``test_a_budget_back_at_the_base...`` (fullgraph)."""
    q, k, v, cu_seqlens = stream(96, 3)
    explanation = torch._dynamo.explain(layer)(q, k, v, cu_seqlens, budget)
    assert explanation.graph_break_count == 0, [str(b.reason)[:200] for b in explanation.break_reasons]
    compiled = torch.compile(layer, fullgraph=True, backend=CountingBackend())
    got, want = compiled(q, k, v, cu_seqlens, budget), layer(q, k, v, cu_seqlens, budget)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    grads = [torch.autograd.grad(out.sum(), (q, k, v)) for out in (got[0], want[0])]
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_budget_values_and_stream_lengths_do_not_compile_again(backend):
    counting = CountingBackend()
    compiled = torch.compile(layer, backend=counting, dynamic=True)
    budgets = [LayerBudget(0.95, 0.6, scale) for scale in (0.7, 0.5)] + [LayerBudget(0.85, 0.4, 1.3)]
    for (num_tokens, docs), budget in zip([(64, 2), (80, 3), (128, 7)], budgets):
        q, k, v, cu_seqlens = stream(num_tokens, docs, seed=num_tokens, device=device_of(backend))
        compiled(q, k, v, cu_seqlens, budget, backend)[0].sum().backward()
    assert counting.graphs == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_budget_back_at_the_base_and_moved_again_gets_its_own_answers(backend):
    """DST moves a budget, returns it to the base, then moves its tau alone: each compiled call equals the eager one,
    forward and gradients (torch.compile's automatic dynamic shapes made a graph traced at the base answer for the
    next budget too)."""
    compiled = torch.compile(layer, fullgraph=True, backend=CountingBackend())  # a graph break raises
    q, k, v, cu_seqlens = stream(64, 2, device=device_of(backend))
    for budget in (TUNED, BASE, LayerBudget(0.3)):
        got, want = compiled(q, k, v, cu_seqlens, budget, backend), layer(q, k, v, cu_seqlens, budget, backend)
        for a, b in zip(got, want):
            assert torch.equal(a, b), budget
        grads = [torch.autograd.grad(out.sum(), (q, k, v)) for out in (got[0], want[0])]
        for a, b in zip(*grads):
            assert torch.equal(a, b), budget


def opcheck(op, args):
    """``torch.library.opcheck``'s checks of what torch.compile is told: the schema and the fake outputs."""
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_custom_ops_torch_compile_runs_agree_with_their_fakes(backend):
    """What torch.compile knows of each custom op (its fake: shapes, dtypes, strides) is what the op returns, for
    inputs laid out as views of [H, T, D] tensors too (inductor checks every output's strides)."""
    device = device_of(backend)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(h, 64, 16, generator=gen).to(device).transpose(0, 1) for h in (4, 2, 2))
    cu_seqlens = torch.tensor([0, 40, 64], dtype=torch.int32, device=device)
    mask = select_with_budget(q, k, cu_seqlens, TUNED, BASE, block_size=16, stride=8, backend=backend).mask
    args = (q, k, v, mask, cu_seqlens, 16, 0.25, backend)
    opcheck(torch.ops.sparsebalance.block_sparse_attention.default, args)
    out, lse = torch.ops.sparsebalance.block_sparse_attention.default(*args)
    grad = torch.randn(4, 64, 16, generator=gen).to(device).transpose(0, 1)
    opcheck(torch.ops.sparsebalance.block_sparse_attention_backward.default,
            (q, k, v, out, lse, grad, mask, cu_seqlens, 16, 0.25, backend))
    if backend == "triton":  # the selection's launches
        from sparsebalance_pl.kernels import selection_triton
        from sparsebalance_pl.kernels.layout import PackedDocuments

        documents = PackedDocuments(cu_seqlens, 64, 16)
        mass = selection_triton.estimate_block_mass(q, k, documents.doc, 16, 8, 0.25)
        opcheck(selection_triton._block_mass_op, (q, k, documents.doc, 16, 8, 0.25))
        budgets = {"mask": [0.9, 2.0], "optional": [0.95, 0.6, 0.9, 2.0]}  # (tau, cap) pairs; cap 2: none
        ranking_args = {first: (mass, documents.doc, cu_seqlens, 16, 1, 1, torch.tensor(taus_caps, dtype=torch.float64),
                                first) for first, taus_caps in budgets.items()}
        for args in ranking_args.values():
            opcheck(selection_triton._rank_op, args)
        _, forced, order, _, cumulative, _, _, _, optional, tiles = selection_triton._rank_op(*ranking_args["optional"])
        scale = torch.tensor([0.7], dtype=torch.float64)
        opcheck(selection_triton._cut_op, (order, cumulative, forced, optional, tiles[0], scale))


def test_flex_attention_compiles_twice_at_most_over_the_stream_lengths_of_an_epoch():
    """The BlockMask of each stream (its lists, its document ids) enters the compiled attention as data: the first
    stream's sizes are compiled as constants, the second's as symbols (torch.compile's automatic dynamic shapes
    for the mask's tensors), and no later length compiles again."""
    backend = CountingBackend()
    compiled = torch.compile(flex_attention, backend=backend, dynamic=True)
    graphs = []
    for num_tokens, docs in [(256, 1), (320, 4), (448, 2), (512, 9), (384, 3), (640, 5)]:
        q, k, v, cu_seqlens = stream(num_tokens, docs, seed=docs)
        mask = torch.rand(4, num_tokens // 16, num_tokens // 16) < 0.5
        layout = TileLayout.build(mask, cu_seqlens, num_tokens, 2, 16)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled(*(x.detach().transpose(0, 1)[None] for x in (q, k, v)), block_mask=block_mask(layout),
                     enable_gqa=True)
        graphs.append(backend.graphs)
    assert graphs == [1, 2, 2, 2, 2, 2]
