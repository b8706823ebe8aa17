"""Bad settings stop before training with one line naming the setting and what is allowed."""

import pytest
from main_runner import REPO
from main_runner import error_of as _error_of


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.attention.backend=flash"], ["backend", "dense", "sparse"]),
        (["--model.attention.tau=1.5"], ["attention.tau", "(0, 1]"]),
        (["--model.attention.tau=0"], ["attention.tau", "(0, 1]"]),
        (["--model.attention.block_size=48"], ["attention.block_size", "power of two"]),
        (["--data.batching.max_tokens=1024", "--data.corpus.max_doc_tokens=4096"], ["data.batching.max_tokens", "data.corpus.max_doc_tokens"]),
        (["--data.corpus.source=folder", "--data.corpus.text_dir=/nonexistent/folder"], ["data.corpus.text_dir", "does not exist"]),
        (["--model.optim.lrr=0.1"], ["lrr"]),
        (["--trainer.not_a_setting=1"], ["not_a_setting"]),
    ],
)
def test_bad_setting_is_named(capsys, monkeypatch, tmp_path, args, expected):
    monkeypatch.chdir(REPO)
    err = _error_of(capsys, *args)
    for text in expected:
        assert text in err, err


def test_empty_data_folder_is_named(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    (tmp_path / "notes.md").write_text("not a corpus file")
    err = _error_of(capsys, "--data.corpus.source=folder", f"--data.corpus.text_dir={tmp_path}")
    assert "data.corpus.text_dir" in err and ".txt or .jsonl" in err


