"""The selection options of ``AttentionConfig`` (estimate, sinks, local window, recall probes, per-head tau) reach
the selection on both paths (whole stream and context-parallel striped), change what a model's forward selects,
and bad values stop with one line naming the field."""

import pytest
import torch
from main_runner import error_of

from sparsebalance_pl import attention as attention_module
from sparsebalance_pl import kernels
from sparsebalance_pl.attention import AttentionConfig, LayerStats, SparseAttention, layer_means
from sparsebalance_pl.context_parallel import ContextParallel
from sparsebalance_pl.datamodules.packing import collate_packed
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.kernels import LayerBudget
from sparsebalance_pl.kernels.launches import count_launches
from sparsebalance_pl.kernels.selection import SELECTION_OPTIONS
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import SparseCausalLM

TINY = {"num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}
OPTIONS = dict(estimate="sampled", sink_blocks=2, local_blocks=3, recall_probes=1, per_head_tau=True)


def test_defaults_are_the_selections_own():
    assert AttentionConfig().selection_options() == SELECTION_OPTIONS


def _qkv(tokens: int = 128):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(tokens, h, 16, generator=gen) for h in (4, 2, 2))


@pytest.mark.parametrize("striped", [False, True])
def test_options_reach_both_selection_calls(monkeypatch, striped):
    seen = {}
    real = kernels.select_with_budget
    rows = torch.tensor([0, 128], dtype=torch.int32)  # one rank's striped rows of 256 tokens, as a whole stream here

    def recording(q, k, documents, *args, **kwargs):
        seen.update(kwargs)
        kwargs.pop("group", None)
        return real(q, k, rows, *args, **kwargs)

    monkeypatch.setattr(kernels, "select_with_budget_striped" if striped else "select_with_budget", recording)
    monkeypatch.setattr(attention_module, "_ring_attention", lambda q, *args: torch.zeros_like(q))
    q, k, v = _qkv()
    cfg = AttentionConfig(block_size=16, stride=4, kernel_backend="torch", **OPTIONS)
    sparse = SparseAttention({**TINY, "num_layers": 1, "head_dim": 16, "vocab_size": 256}, cfg)
    cu_seqlens = torch.tensor([0, 256 if striped else 128], dtype=torch.int32)  # the whole stream's
    batch = sparse.begin(cu_seqlens, training=False, context_parallel=ContextParallel(size=2 if striped else 1))
    sparse.attend(0, q, k, v, cu_seqlens)
    assert {name: seen[name] for name in OPTIONS} == OPTIONS
    assert (seen["block_size"], seen["stride"], seen["backend"]) == (16, 4, "torch")
    assert ("group" in seen) == striped
    assert 0 in batch.masks and 0 in batch.stats


def _forward_stats(**options) -> tuple[list[float], list[float]]:
    """Per-layer (density, estimated recall) of a tiny model's forward on a packed micro-batch."""
    torch.manual_seed(0)
    module = SparseCausalLM(model=ModelConfig(preset="demo", overrides=TINY),
                        attention=AttentionConfig(block_size=16, stride=4, tau=0.5, kernel_backend="torch", **options))
    module.configure_model()
    module.eval()
    gen = torch.Generator().manual_seed(1)
    batch = collate_packed([{"tokens": torch.randint(0, 256, (n,), generator=gen).numpy()} for n in (200, 56)])
    with torch.no_grad():
        module.net.hf.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                            sparse_attention=module.begin_micro_batch(batch))
    report = module.sparse_attention.report()
    return report.density, report.estimated_recall


def test_options_change_the_forwards_selection():
    density, estimated = _forward_stats()
    wider, _ = _forward_stats(local_blocks=4, sink_blocks=2)
    assert all(w > d for w, d in zip(wider, density)), (wider, density)
    probed_density, probed = _forward_stats(recall_probes=1)
    assert probed_density == density  # the probes move the estimate, never the mask
    assert probed != estimated
    sampled, _ = _forward_stats(estimate="sampled")
    assert sampled != density


@pytest.mark.parametrize(
    "options, field",
    [({"estimate": "pooled"}, "attention.estimate"), ({"sink_blocks": -1}, "attention.sink_blocks"),
     ({"local_blocks": 0}, "attention.local_blocks"), ({"recall_probes": -1}, "attention.recall_probes"),
     ({"per_head_tau": True}, "attention.per_head_tau")],
)
def test_bad_options_name_their_field(options, field):
    with pytest.raises(ConfigError, match=rf"^{field}"):
        AttentionConfig(**options)


def test_a_bad_option_on_the_command_line_is_named(capsys, monkeypatch):
    from main_runner import REPO

    monkeypatch.chdir(REPO)
    err = error_of(capsys, "--model.attention.estimate=pooled")
    assert "attention.estimate" in err and "sampled" in err, err


@pytest.mark.parametrize("budget", [LayerBudget(0.5), LayerBudget(0.7, None, 0.6)], ids=["base", "moved"])
def test_layer_means_reduce_all_layers_as_each_selection_would(budget):
    """What the forward keeps of each layer's selection, reduced for all layers at once after the backward, equals
    each selection's own means."""
    cu_seqlens = torch.tensor([0, 50, 128], dtype=torch.int32)
    base, selections = LayerBudget(0.5), []
    for seed in range(3):
        q, k, _ = (x * (1 + seed) for x in _qkv())
        selections.append(kernels.select_with_budget(q, k, cu_seqlens, budget, base, block_size=16, stride=4,
                                                     backend="torch"))
    means = layer_means([LayerStats.of(selection) for selection in selections])
    for name, per_layer in (("density", lambda s: s.stats.mean_density()),
                            ("estimated_recall", lambda s: s.stats.mean_kept_mass()),
                            ("base_density", lambda s: s.base_stats.mean_density()),
                            ("base_estimated_recall", lambda s: s.base_stats.mean_kept_mass())):
        torch.testing.assert_close(means[name], torch.stack([per_layer(s).float() for s in selections]))
    documents = torch.stack([selection.base_document_density for selection in selections]).mean(0)
    torch.testing.assert_close(means["base_document_density"], documents)


def test_layer_means_cost_the_same_launches_and_one_read_for_any_number_of_layers():
    cu_seqlens = torch.tensor([0, 50, 128], dtype=torch.int32)
    q, k, _ = _qkv()
    selection = kernels.select_with_budget(q, k, cu_seqlens, LayerBudget(0.5), LayerBudget(0.5), block_size=16,
                                           stride=4, backend="torch")
    counts = []
    for num_layers in (2, 24):
        with count_launches(as_device=True) as count:
            means = layer_means([LayerStats.of(selection)] * num_layers)
            torch.cat([x.double() for x in means.values()]).tolist()
        counts.append((count.launches, count.host_syncs))
    assert counts[0] == counts[1] and counts[0][1] == 1
