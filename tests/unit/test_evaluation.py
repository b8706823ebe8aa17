"""Answer scoring: exact match of greedy predictions over each answer span."""

import torch

from sparsebalance_pl.model import answer_exact_match
from sparsebalance_pl.metrics import CellAccuracy


def test_answer_exact_match_checks_every_answer_token():
    vocab = 10
    input_ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    predicted_next = torch.tensor([2, 3, 9, 5, 6, 7, 0, 0])  # position t predicts input_ids[t + 1] except t=2
    hidden = torch.nn.functional.one_hot(predicted_next, vocab).float()
    weight = torch.eye(vocab)
    spans = torch.tensor([[1, 3], [3, 5], [4, 7]])  # needs predictions at 0-1, 2-3 (wrong at 2), 3-5
    assert answer_exact_match(hidden, weight, input_ids, spans).tolist() == [True, False, True]


def test_cell_accuracy_counts_per_cell():
    metric = CellAccuracy(["passkey@512", "passkey@1024", "kv@512"])
    metric.update(torch.tensor([0, 0, 2]), torch.tensor([True, False, True]))
    result = {k: float(v) for k, v in metric.compute().items()}
    assert result == {"passkey@512": 0.5, "kv@512": 1.0}  # cells without samples are left out
