"""A training checkpoint (single file or FSDP2's distributed-checkpoint folder) exported as a Hugging Face
directory gives the same model, loadable through ``model.pretrained_path`` and by transformers itself; a damaged
one is refused in one line before any of it is read."""


import pytest
import torch
from torch.distributed import checkpoint as dcp
from transformers import AutoModelForCausalLM
from checkpoint_files import flip_bytes, write_checkpoint
from main_runner import REPO, error_of

from sparsebalance_pl import cli
from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.export import export_checkpoint
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import SparseCausalLM

DEMO = REPO / "configs" / "demo.yaml"
TINY = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}


def _trained_like_module(family: str = "qwen2") -> SparseCausalLM:
    torch.manual_seed(0)
    module = SparseCausalLM(model=ModelConfig(model_type=family, overrides=TINY),
                            attention=AttentionConfig(backend="dense"))
    module.configure_model()
    with torch.no_grad():  # move away from the initialisation so a silent re-initialisation would show
        for p in module.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return module


def _save_single_file(module: SparseCausalLM, path) -> None:
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)  # as Lightning does
    torch.save(checkpoint, path)


def _save_distributed(module: SparseCausalLM, path) -> None:  # without its configuration: an older checkpoint
    dcp.save({"state_dict": module.state_dict()}, checkpoint_id=str(path), no_dist=True)
    torch.save({"hyper_parameters": dict(module.hparams), "global_step": 7}, path / "meta.pt")


def _save_with_dims(module: SparseCausalLM, path) -> None:  # a checkpoint from when every model was a Qwen2
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                  "model_dims": module.dims.as_dict()}
    torch.save(checkpoint, path)


@pytest.mark.parametrize("save, family", [(_save_single_file, "llama"), (_save_single_file, "qwen3"),
                                          (_save_distributed, "qwen2"), (_save_with_dims, "qwen2")])
def test_exported_model_equals_the_trained_one(tmp_path, save, family):
    module = _trained_like_module(family)
    ckpt = tmp_path / "ckpt"
    save(module, ckpt)
    out = export_checkpoint(ckpt, tmp_path / "hf")
    ids = torch.randint(0, module.dims.vocab_size, (1, 40))
    reloaded = SparseCausalLM(model=ModelConfig(pretrained_path=str(out)), attention=AttentionConfig(backend="dense"))
    reloaded.configure_model()
    plain = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert plain.config.model_type == family
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        ours = _logits(module, ids)
        assert torch.allclose(ours, want, atol=1e-5)
        assert torch.allclose(_logits(reloaded, ids), want, atol=1e-5)
    assert reloaded.dims == module.dims


def _logits(module: SparseCausalLM, ids: torch.Tensor) -> torch.Tensor:
    batch = {"cu_seqlens": torch.tensor([0, ids.shape[1]], dtype=torch.int32)}
    hidden = module.net.hf.get_decoder()(
        input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False,
        sparse_attention=module.begin_micro_batch(batch),
    ).last_hidden_state
    return module.net.hf.get_output_embeddings()(hidden)


def test_bad_checkpoint_paths_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "hf")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match="not a distributed checkpoint"):
        export_checkpoint(tmp_path / "folder", tmp_path / "hf")
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        export_checkpoint(tmp_path / "text.ckpt", tmp_path / "hf")
    torch.save({"state_dict": {}}, tmp_path / "other.ckpt")
    with pytest.raises(ConfigError, match="no SparseCausalLM weights"):
        export_checkpoint(tmp_path / "other.ckpt", tmp_path / "hf")


@pytest.mark.parametrize("config", [[], ["--config", str(DEMO)]], ids=["no config", "with config"])
def test_main_py_export_writes_a_loadable_directory(tmp_path, capsys, config):
    module = _trained_like_module()
    _save_single_file(module, tmp_path / "last.ckpt")
    out = cli.main(["export", *config, "--ckpt_path", str(tmp_path / "last.ckpt"), "--out_dir", str(tmp_path / "hf")])
    assert AutoModelForCausalLM.from_pretrained(out, local_files_only=True).config.hidden_size == 64
    assert f"model written to {out}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # a bad path is one line and exit code 2, like any bad setting
        cli.main(["export", *config, "--ckpt_path", str(tmp_path / "missing.ckpt"), "--out_dir", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "does not exist" in err and "Traceback" not in err


def test_export_needs_no_longer_the_directory_the_run_started_from(tmp_path):
    _save_single_file(_trained_like_module(), tmp_path / "a.ckpt")
    start = export_checkpoint(tmp_path / "a.ckpt", tmp_path / "start")
    module = SparseCausalLM(model=ModelConfig(pretrained_path=str(start)), attention=AttentionConfig(backend="dense"))
    module.configure_model()
    _save_single_file(module, tmp_path / "b.ckpt")
    for file in start.iterdir():
        file.unlink()
    start.rmdir()
    out = export_checkpoint(tmp_path / "b.ckpt", tmp_path / "hf")
    ids = torch.randint(0, module.dims.vocab_size, (1, 24))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)(input_ids=ids).logits
        assert torch.allclose(_logits(module, ids), want, atol=1e-5)


def test_a_damaged_checkpoint_is_refused_before_anything_is_read(tmp_path, capsys):
    folder = write_checkpoint(tmp_path / "last.ckpt", 2)
    flip_bytes(folder / "__0_0.distcp")
    err = error_of(capsys, command=("export", "--ckpt_path", str(folder), "--out_dir", str(tmp_path / "hf")))
    assert err == (
        f"error: checkpoint {folder} is damaged (__0_0.distcp differs from the checksum recorded when it was saved); "
        f"{tmp_path} holds no intact checkpoint\n"
    )
    assert not (tmp_path / "hf").exists()
