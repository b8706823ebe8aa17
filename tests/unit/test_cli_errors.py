"""The bad inputs tried: each stops ``main.py`` with exit code 2 and one line naming the setting, no traceback.
The project's own settings, the configuration parser's, Lightning's Trainer arguments (checked when the Trainer is
built, before any rank starts) and its fit loop's intervals (checked by every rank once the plan is known)."""

import pytest
from lightning.pytorch.accelerators import CUDAAccelerator
from main_runner import REPO, build_demo_data
from main_runner import error_of as _error_of

DEMO = str(REPO / "configs" / "demo.yaml")
FIT_DEMO = ("fit", "--config", DEMO)
NO_GPU = pytest.mark.skipif(CUDAAccelerator.is_available(), reason="this machine has a GPU")
SMALL_CORPUS = {"corpus.num_documents": 40, "corpus.max_doc_tokens": 512, "batching.max_tokens": 1024}

BAD_INPUTS = [
    pytest.param(FIT_DEMO, ["--model.attention.backend=flash"], ["backend", "dense", "sparse"], id="attention backend"),
    pytest.param(FIT_DEMO, ["--model.attention.tau=1.5"], ["attention.tau", "(0, 1]"], id="tau above 1"),
    pytest.param(FIT_DEMO, ["--model.attention.tau=0"], ["attention.tau", "(0, 1]"], id="tau 0"),
    pytest.param(FIT_DEMO, ["--model.attention.block_size=48"], ["attention.block_size", "power of two"],
                 id="block size"),
    pytest.param(FIT_DEMO, ["--data.batching.max_tokens=1024", "--data.corpus.max_doc_tokens=4096"],
                 ["data.batching.max_tokens", "data.corpus.max_doc_tokens"], id="micro-batch below document"),
    pytest.param(FIT_DEMO, ["--data.corpus.source=folder", "--data.corpus.text_dir=/nonexistent/folder"],
                 ["data.corpus.text_dir", "does not exist"], id="missing text folder"),
    pytest.param(FIT_DEMO, ["--model.optim.lrr=0.1"], ["lrr"], id="unknown key"),
    pytest.param(FIT_DEMO, ["--trainer.not_a_setting=1"], ["not_a_setting", "--help"], id="unknown trainer key"),
    pytest.param(FIT_DEMO, ["--trainer.precision=17"], ["trainer.precision", "Given value: 17"], id="precision"),
    pytest.param(("fit", "--config", "configs/missing.yaml"), [], ["configs/missing.yaml", "does not exist"],
                 id="missing config"),
    pytest.param(("fitt", "--config", DEMO), [], ["fitt"], id="unknown command"),
    pytest.param(FIT_DEMO, ["--trainer.devices=0"], ["devices='0'", "not a valid input"], id="devices 0"),
    pytest.param(FIT_DEMO, ["--trainer.devices=-2"], ["devices", "int > 0"], id="devices negative"),
    pytest.param(FIT_DEMO, ["--trainer.num_nodes=0"], ["num_nodes", "positive integer"], id="num_nodes 0"),
    pytest.param(FIT_DEMO, ["--trainer.strategy=nope"], ["strategy='nope'"], id="unknown strategy"),
    pytest.param(FIT_DEMO, ["--trainer.max_steps=-5"], ["max_steps", "-5"], id="max_steps negative"),
    pytest.param(FIT_DEMO, ["--trainer.gradient_clip_algorithm=foo"], ["gradient_clip_algorithm", "foo"],
                 id="gradient clip algorithm"),
    pytest.param(FIT_DEMO, ["--trainer.accelerator=tpu"], ["torch_xla"], id="accelerator without its package"),
    pytest.param(("fit", "--config", str(REPO / "configs" / "qwen05b.yaml")), [],
                 ["configs/qwen05b.yaml trains on GPUs", "none", "configs/demo.yaml trains on the CPU"],
                 id="GPU config without a GPU", marks=NO_GPU),
    pytest.param(FIT_DEMO, ["--trainer.accelerator=gpu"], ["trainer.accelerator=gpu", "configs/demo.yaml"],
                 id="GPU accelerator without a GPU", marks=NO_GPU),
    pytest.param(FIT_DEMO, ["--model.attention.kernel_backend=flex"],
                 ["kernel_backend=flex trains on CUDA only", "use torch or auto on the CPU"],
                 id="flex kernels training on the CPU", marks=NO_GPU),
    pytest.param(FIT_DEMO, ["--model.attention.kernel_backend=cuda"], ["kernel_backend", "cuda"],
                 id="unknown kernel backend"),
    pytest.param(FIT_DEMO, ["--ckpt_path=missing.ckpt"], ["ckpt_path=missing.ckpt", "no such checkpoint"],
                 id="missing checkpoint"),
    pytest.param(("validate", "--config", DEMO), ["--ckpt_path=missing.ckpt"], ["no such checkpoint"],
                 id="validate from a missing checkpoint"),
    pytest.param(FIT_DEMO, ["--trainer.val_check_interval=100000", "--trainer.devices=1", "--trainer.strategy=auto",
                            "--model.model.overrides={num_layers: 1}",
                            *(f"--data.{key}={value}" for key, value in SMALL_CORPUS.items())],
                 ["`val_check_interval` (100000)", "number of the training batches"],
                 id="validation interval past the epoch"),
]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """The corpus the demo builds with ``SMALL_CORPUS``, for the input found only once the epoch is planned."""
    built = tmp_path_factory.mktemp("small_corpus")
    build_demo_data(built, **SMALL_CORPUS)
    return built / "data"


@pytest.mark.parametrize("command, args, expected", BAD_INPUTS)
def test_bad_input_is_named_in_one_line(capsys, monkeypatch, tmp_path, request, command, args, expected):
    monkeypatch.chdir(tmp_path)  # where a run that got as far as training writes its outputs
    if "--trainer.val_check_interval=100000" in args:  # one rank in this process, on a corpus built beforehand
        (tmp_path / "data").symlink_to(request.getfixturevalue("small_corpus"))
    err = _error_of(capsys, *args, command=command)
    for text in expected:
        assert text in err, err


def test_empty_data_folder_is_named(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    (tmp_path / "notes.md").write_text("not a corpus file")
    err = _error_of(capsys, "--data.corpus.source=folder", f"--data.corpus.text_dir={tmp_path}")
    assert "data.corpus.text_dir" in err and ".txt or .jsonl" in err
