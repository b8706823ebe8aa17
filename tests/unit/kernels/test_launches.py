"""The launch and host-synchronisation counter, and the budget it holds the device path to: one layer's selection
and attention, forward and backward, on the Triton path (the interpreter's on the CPU) reads nothing back from
the device, and launches at most 40 kernels, as many whatever the number of documents and the stream's length."""

from types import SimpleNamespace

import pytest
import torch
from attention_cases import TRITON_OK
from triton.backends.compiler import GPUTarget

from sparsebalance_pl.kernels import LayerBudget, PackedDocuments, block_sparse_attention, select_with_budget
from sparsebalance_pl.kernels.attention import resolve_backend
from sparsebalance_pl.kernels.attention_triton import _fwd_kernel
from sparsebalance_pl.kernels.cross_compile import compiling_for
from sparsebalance_pl.kernels.launches import compiled_not_run, count_launches, host_readable, host_side_only, launch


def test_the_counter_sees_launches_and_every_kind_of_host_read():
    x = torch.arange(6.0)
    with count_launches() as count:
        y = x + 1
        y.sum().item()
        y.tolist()
        bool(y[0] > 0)
        torch.nonzero(y > 2)
        y[y > 2]
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # sized: no read
        y.view(2, 3).t()  # views launch nothing
    assert count.ops["add"] == 1 and count.ops["sum"] == 1 and "view" not in count.ops and "t" not in count.ops
    assert count.syncs == {
        "Tensor.item": 1, "Tensor.tolist": 1, "Tensor.__bool__": 1, "nonzero": 1, "index with a boolean mask": 1,
        "repeat_interleave without output_size": 1,
    }
    assert count.launches == sum(count.ops.values())


def test_a_kernel_given_real_tensors_is_neither_compiled_nor_run_in_their_place():
    out = torch.zeros(4)
    with count_launches() as count, compiled_not_run() as compiled:
        with pytest.raises(RuntimeError, match="_fwd_kernel: .* pass meta tensors"):
            launch(_fwd_kernel, (1,), out)
    assert compiled == [] and not out.any() and count.launches == 0


def test_triton_on_meta_tensors_is_refused_unless_compiling():
    q = torch.empty(64, 2, 16, device="meta")
    cu_seqlens = torch.tensor([0, 64], dtype=torch.int32, device="meta")
    mask = torch.ones(2, 4, 4, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="meta tensors only compile"):
        block_sparse_attention(q, q, q, mask, cu_seqlens, block_size=16, backend="triton")
    with compiled_not_run():
        assert resolve_backend("triton", q.device) == "triton"


class KernelNeeding:
    """Stands in for a Triton kernel whose binary needs ``shared[stages]`` bytes of shared memory."""

    def __init__(self, shared: dict[int, int]) -> None:
        self.shared, self.compiled = shared, []

    def warmup(self, *args, grid, num_stages, **kwargs):
        self.compiled.append(num_stages)
        return SimpleNamespace(metadata=SimpleNamespace(shared=self.shared[num_stages]))


def test_a_launch_takes_the_most_stages_that_fit_the_gpus_shared_memory(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.empty(4, device="meta")
    kib = 1024
    with compiling_for(GPUTarget("cuda", 86, 32)) as compiled:  # 99 KiB a program
        fitting = KernelNeeding({3: 105 * kib, 2: 72 * kib, 1: 40 * kib})
        for _ in range(2):
            launch(fitting, (1,), x, BLOCK=64, num_stages=3)
        assert fitting.compiled == [3, 2, 2, 2]  # found once, then only the launches' own compilations
        assert len(compiled) == 2
        with pytest.raises(RuntimeError, match="needs 100.0 KiB of shared memory per program, more than the 99 KiB"):
            launch(KernelNeeding({2: 120 * kib, 1: 100 * kib}), (1,), x, num_stages=2)


def test_host_side_only_counts_a_launch_without_compiling_or_running_it_and_reads_as_a_device_would():
    kernel, x = KernelNeeding({3: 0}), torch.zeros(4)  # the stand-in cannot run: ``kernel[grid]`` would fail
    with count_launches() as count, host_side_only():
        launch(kernel, (1,), x, num_stages=3)
        assert not host_readable(x)
    assert kernel.compiled == [] and count.launches == 1 and host_readable(x)


@pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
def test_a_layer_run_host_side_only_takes_the_device_paths_steps_without_its_kernels():
    with host_side_only():
        skipped = _layer(32, 1, LayerBudget(0.9))
    ran = _layer(32, 1, LayerBudget(0.9))
    assert skipped.ops == ran.ops and skipped.triton == ran.triton and skipped.host_syncs == 0


def _layer(num_tokens: int, docs: int, budget: LayerBudget, shared: bool = False):
    """Counts one layer's selection (with the stats a module logs) and attention, forward and backward; ``shared``:
    on the stream's ``PackedDocuments``, made before (as by an earlier layer)."""
    gen = torch.Generator().manual_seed(num_tokens + docs)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(num_tokens, h, 16, generator=gen).to(device).requires_grad_() for h in (2, 1, 1))
    bounds = torch.linspace(0, num_tokens, docs + 1).round().int().to(device)
    if shared:
        bounds = PackedDocuments(bounds, num_tokens, 16)
        bounds.candidates  # derived before, by an earlier layer
    grad = torch.randn(num_tokens, 2, 16, generator=gen).to(device)
    with count_launches(as_device=device == "cpu") as count:
        selection = select_with_budget(q.detach(), k.detach(), bounds, budget, LayerBudget(0.9), block_size=16,
                                       stride=8, backend="triton")
        for stats in (selection.stats, selection.base_stats):
            stats.mean_density(), stats.mean_kept_mass()
        out = block_sparse_attention(q, k, v, selection.mask, bounds, block_size=16, backend="triton")
        out.backward(grad)
    return count


@pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("budget", [LayerBudget(0.9), LayerBudget(0.95, None, 0.7)], ids=["base", "tuned"])
def test_the_device_path_reads_nothing_back_and_launches_a_fixed_number_of_kernels(budget):
    counts = {(n, docs): _layer(n, docs, budget, shared=True) for n, docs in [(32, 1), (256, 1), (256, 64)]}
    for count in counts.values():
        assert count.host_syncs == 0, count.summary()
    launches = {key: count.launches for key, count in counts.items()}
    assert len(set(launches.values())) == 1, launches
    assert launches[(32, 1)] <= 40  # the budget: a few launches of selection and attention, forward and backward
    # the layers of a model share the stream's documents; without them each layer derives them again
    assert _layer(32, 1, budget).launches > launches[(32, 1)]
    assert counts[(32, 1)].ops == counts[(256, 64)].ops and counts[(32, 1)].triton == counts[(256, 64)].triton
