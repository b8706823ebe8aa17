"""LongBench-format evaluation: reading local JSONL files, QA F1 and exact match, and the test step end to end."""

import json
import logging
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import Qwen2ForCausalLM
from main_runner import REPO

from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.cli import main
from sparsebalance_pl.datamodules import BatchingConfig, CorpusConfig, EvaluationConfig, LongContextDataModule
from sparsebalance_pl.datamodules.longbench import collate_prompts, make_prompts, read_longbench, truncate_middle
from sparsebalance_pl.datamodules.tokenizer import ByteTokenizer
from sparsebalance_pl.errors import ConfigError, DataError
from sparsebalance_pl.evaluation import greedy_generate, normalize_answer, qa_f1, qa_scores
from sparsebalance_pl.metrics import CellMeans
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import SparseCausalLM

TINY = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}


def _record(dataset: str, answer: str, length: int = 100, **extra) -> dict:
    return {"input": f"Where is the {answer}?", "context": f"The {answer} is in the box. " * 3,
            "answers": [answer], "length": length, "dataset": dataset, **extra}


def _write_jsonl(path: Path, records: list[dict], extra_lines: tuple[bytes, ...] = ()) -> Path:
    lines = [json.dumps(r).encode() for r in records]
    path.write_bytes(b"\n".join(lines + list(extra_lines)) + b"\n")
    return path


@pytest.mark.parametrize(
    "prediction, reference, f1",
    [
        ("The Cat, sat!", "cat sat", 1.0),
        ("the cat sat", "a cat sat down", 0.8),  # precision 1, recall 2/3
        ("an   apple\tpie.", "Apple pie", 1.0),
        ("dog", "cat", 0.0),
        ("", "", 1.0),
        ("the", "cat", 0.0),  # only an article: nothing left to match
    ],
)
def test_qa_f1_uses_squad_normalisation(prediction, reference, f1):
    assert qa_f1(prediction, reference) == pytest.approx(f1)


def test_scores_take_the_best_reference():
    assert normalize_answer(" The Eiffel-Tower, Paris. ") == "eiffeltower paris"
    assert qa_scores("Paris.", ["France", "paris"]) == (1.0, 1.0)
    f1, exact = qa_scores("in Paris France", ["Paris", "Lyon"])
    assert f1 == pytest.approx(0.5) and exact == 0.0


def test_right_answers_score_one():
    """A model that always produces the reference answer (then end of text) gets F1 and exact match 1.0."""
    tok = ByteTokenizer()
    answers = ["42", "the blue box", "Marie Curie"]
    prompts = [tok.encode(f"question {i}\nAnswer:") for i in range(3)]

    def oracle(sequences):
        out = []
        for prompt, answer, seq in zip(prompts, answers, sequences):
            target = tok.encode(" " + answer) + [tok.eos_id]
            out.append(target[min(len(seq) - len(prompt), len(target) - 1)])
        return out

    generated = greedy_generate(oracle, prompts, max_new_tokens=32, eos_id=tok.eos_id)
    assert [tok.decode(g) for g in generated] == [" " + a for a in answers]
    scores = torch.tensor([qa_scores(tok.decode(g), [a]) for g, a in zip(generated, answers)])
    metric = CellMeans(["qa", "qa@0-4k"], ["f1", "exact_match"])
    metric.update(torch.tensor([[0, 1]] * 3), scores)
    result = metric.compute()
    assert {k: float(v) for k, v in result["f1"].items()} == {"qa": 1.0, "qa@0-4k": 1.0}
    assert {k: float(v) for k, v in result["exact_match"].items()} == {"qa": 1.0, "qa@0-4k": 1.0}


def test_generation_stops_at_eos_or_the_token_limit():
    calls = []

    def next_tokens(sequences):
        calls.append([len(s) for s in sequences])
        return [9, 9 if len(sequences[1]) < 4 else 0]  # the second sequence ends (eos 0) after two tokens

    assert greedy_generate(next_tokens, [[1], [1, 2]], max_new_tokens=3, eos_id=0) == [[9, 9, 9], [9, 9]]
    assert calls == [[1, 2], [2, 3], [3, 4]]  # no cache: each step re-reads every whole sequence


def test_packed_greedy_generation_matches_hugging_face_per_prompt():
    """Recomputing the packed stream per token gives what greedy decoding of each prompt alone gives."""
    torch.manual_seed(0)
    module = SparseCausalLM(model=ModelConfig(preset="demo", overrides=TINY),
                            attention=AttentionConfig(backend="dense"))
    module.configure_model()
    module.eval()
    for name, weight in module.net.named_parameters():
        if "layers" in name and weight.ndim == 2:
            weight.data.normal_(0.0, 0.2)  # at the default scale a tiny model just repeats its last token
    reference = Qwen2ForCausalLM(module.net.hf.config.__class__(**{
        **module.net.hf.config.to_dict(), "attn_implementation": "eager"}))
    reference.load_state_dict(module.net.hf.state_dict())
    reference.eval()
    prompts = [torch.randint(0, 257, (n,)).tolist() for n in (9, 30, 17)]
    with torch.no_grad():
        packed = greedy_generate(module.greedy_next_tokens, prompts, max_new_tokens=5, eos_id=-1)
        for prompt, got in zip(prompts, packed):
            ids = list(prompt)
            for _ in range(5):
                ids.append(int(reference(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
            assert got == ids[len(prompt):]


def test_loader_skips_and_counts_malformed_lines(tmp_path, caplog):
    good = [_record("hotpotqa", "key", length=100, _id="a1", language="en", all_classes=None),
            _record("hotpotqa", "cup", length=5000), _record("trec", "pen", length=9000)]
    path = _write_jsonl(tmp_path / "mixed.jsonl", good, extra_lines=(
        b"{not json",
        b'{"input": "q", "context": "caf\xe9", "answers": ["x"], "length": 1, "dataset": "d"}',  # latin-1 byte
        json.dumps({**good[0], "answers": []}).encode(),
        b"",
        b"[1, 2]",
    ))
    with caplog.at_level(logging.WARNING):
        records = read_longbench(str(path))
    assert [(r.dataset, r.answers, r.bucket) for r in records] == [
        ("hotpotqa", ("key",), "0-4k"), ("hotpotqa", ("cup",), "4-8k"), ("trec", ("pen",), "8k+")]
    messages = caplog.text
    assert f"{path}:4: skipped, not JSON" in messages
    assert f"{path}:5: skipped, not valid UTF-8" in messages
    assert f"{path}:6: skipped, answers must be a non-empty list" in messages
    assert f"{path}:8: skipped, a JSON list" in messages
    assert "4 malformed line(s) skipped, 3 samples read" in messages


def test_folder_missing_path_and_file_without_valid_lines(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", [_record("qa", "x")])
    (tmp_path / "sub").mkdir()
    _write_jsonl(tmp_path / "sub" / "b.jsonl", [_record("qb", "y")])
    assert [r.dataset for r in read_longbench(str(tmp_path))] == ["qa", "qb"]
    with pytest.raises(ConfigError, match="does not exist"):
        read_longbench(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"{}\n\xff\n")
    with pytest.raises(DataError, match=f"{bad}: no valid LongBench line"):
        read_longbench(str(bad))


def test_prompts_follow_longbench_layout_and_are_cut_in_the_middle(tmp_path, caplog):
    tok = ByteTokenizer()
    records = read_longbench(str(_write_jsonl(tmp_path / "d.jsonl", [_record("qa", "key"), _record("qb", "x" * 300)])))
    assert records[0].prompt == f"{records[0].context}\n\nQuestion: Where is the key?\nAnswer:"
    assert truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert truncate_middle(list(range(10)), 5) == [0, 1, 7, 8, 9]
    with caplog.at_level(logging.WARNING):
        samples = make_prompts(records, tok, max_prompt_tokens=200)
    assert "1 of 2 prompts longer than data.evaluation.longbench_max_tokens=200 were truncated" in caplog.text
    cut = tok.decode(samples[1]["tokens"].tolist())
    assert len(samples[1]["tokens"]) == 200 and cut.startswith("The xxx") and cut.endswith("?\nAnswer:")
    batch = collate_prompts([samples[0], {**samples[1], "bears_loss": False}])
    assert batch["scored"].tolist() == [True, False]
    assert batch["cells"].tolist() == [[0, 2], [1, 3]]  # cells: qa, qb, qa@0-4k, qb@0-4k


def _test_scores(tmp_path, next_tokens=None) -> dict:
    """``trainer.test`` on two hotpotqa records (0-4k and 4-8k) and one trec record, plus one passkey cell;
    ``next_tokens`` replaces the model's greedy predictions."""
    path = _write_jsonl(tmp_path / "lb.jsonl", [_record("hotpotqa", "key"), _record("hotpotqa", "cup", length=5000),
                                                 _record("trec", "pen")])
    data = LongContextDataModule(
        CorpusConfig(data_dir=str(tmp_path / "unused"), max_doc_tokens=256), BatchingConfig(max_tokens=512),
        EvaluationConfig(tasks=["passkey"], lengths=[128], samples_per_cell=1, longbench=str(path), max_new_tokens=3),
    )
    data.prepare_data = lambda: None  # the test splits are generated in memory; no training corpus needed
    torch.manual_seed(0)
    module = SparseCausalLM(model=ModelConfig(preset="demo", overrides=TINY),
                        attention=AttentionConfig(backend="sparse", block_size=16, stride=4, tau=0.9))
    if next_tokens is not None:
        module.greedy_next_tokens = next_tokens
    module.evaluations = data.evaluations()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=tmp_path)
    (results,) = trainer.test(module, datamodule=data, verbose=False)
    return results


def test_test_step_logs_scores_per_dataset(tmp_path):
    results = _test_scores(tmp_path)
    expected = {f"test/longbench/{score}/{cell}" for score in ("f1", "exact_match")
                for cell in ("hotpotqa", "trec", "hotpotqa@0-4k", "hotpotqa@4-8k", "trec@0-4k")}
    assert set(results) == expected | {"test/accuracy/passkey@128"}
    assert all(0.0 <= v <= 1.0 for v in results.values())


def test_scores_are_averaged_per_dataset_and_bucket(tmp_path):
    """An oracle answers "key" and "pen" right and "cup" wrong ("mug"): each cell's mean shows where."""

    def oracle(sequences: list[list[int]]) -> list[int]:
        predicted = []
        for sequence in sequences:
            text = bytes(t for t in sequence if t < 256).decode()
            word = re.search(r"The (\w+) is in the box", text).group(1)
            answer, so_far = ("mug" if word == "cup" else word), text.rsplit("Answer:", 1)[1]
            predicted.append(ord(answer[len(so_far)]) if len(so_far) < len(answer) else ByteTokenizer.eos_id)
        return predicted

    results = _test_scores(tmp_path, oracle)
    for score in ("f1", "exact_match"):
        cells = {k.rsplit("/", 1)[1]: v for k, v in results.items() if k.startswith(f"test/longbench/{score}/")}
        assert cells == {"hotpotqa": 0.5, "hotpotqa@0-4k": 1.0, "hotpotqa@4-8k": 0.0, "trec": 1.0, "trec@0-4k": 1.0}


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--data.evaluation.longbench=/nonexistent/longbench"], ["data.evaluation.longbench", "does not exist"]),
        (["--data.evaluation.longbench=/nonexistent/longbench", "--data.evaluation.max_new_tokens=4096"],
         ["data.evaluation.longbench_max_tokens", "data.batching.max_tokens - data.evaluation.max_new_tokens = 0"]),
    ],
)
def test_bad_longbench_settings_stop_with_one_line(capsys, monkeypatch, args, expected):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--config", "configs/demo.yaml", *args])
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and "Traceback" not in err and line.startswith("error: ")
    for text in expected:
        assert text in line, err
