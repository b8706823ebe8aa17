"""Turn a training checkpoint into a local Hugging Face model directory (config.json plus safetensors).

Training saves either one file or, under FSDP2, a distributed-checkpoint folder; both hold the module's
hyperparameters, the model's Hugging Face configuration and the weights under ``net.hf.``. The exported directory
is what ``model.pretrained_path`` reads, so a trained model can seed new runs (the benchmarks start every variant
from one) or be loaded by transformers directly, as the family it is (its attention implementation is set to
``sdpa``).
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

import torch
from transformers import AutoConfig

from sparsebalance_pl import checkpoints
from sparsebalance_pl.errors import ConfigError, DataError
from sparsebalance_pl.model import ModelConfig, ModelDims, build_model

_WEIGHTS = "net.hf."


def read_checkpoint(ckpt_path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(everything but the tensors: hyperparameters, model dimensions, loop state, ...; Hugging Face state
    dict) of a Lightning checkpoint file or DCP folder."""
    path = Path(ckpt_path)
    if path.is_dir():
        if not (path / "meta.pt").is_file() or not (path / ".metadata").is_file():
            raise ConfigError(f"{path} is a folder but not a distributed checkpoint (no meta.pt or .metadata)")
        _verify(path)
        from torch.distributed import checkpoint as dcp

        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=False)
        reader = dcp.FileSystemReader(str(path))
        stored = reader.read_metadata().state_dict_metadata
        prefix = "state_dict." + _WEIGHTS
        state = {
            key: torch.empty(md.size, dtype=md.properties.dtype)
            for key, md in stored.items()
            if key.startswith(prefix)
        }
        dcp.load(state, storage_reader=reader, no_dist=True)
        weights = {key[len(prefix):]: value for key, value in state.items()}
    elif path.is_file():
        if zipfile.is_zipfile(path):  # what is no archive at all is no checkpoint, said below
            _verify(path)
        try:
            meta = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # pickle and zip errors of every kind
            raise ConfigError(f"{path} is not a readable checkpoint ({type(err).__name__}: {err})") from err
        weights = {k[len(_WEIGHTS):]: v for k, v in meta.get("state_dict", {}).items() if k.startswith(_WEIGHTS)}
    else:
        raise ConfigError(f"checkpoint {path} does not exist")
    if not isinstance(meta, dict) or not weights or "hyper_parameters" not in meta:
        raise ConfigError(f"{path} holds no SparseCausalLM weights and hyperparameters (is it a SparseCausalLM "
                          "checkpoint?)")
    return meta, weights


def _verify(path: Path) -> None:
    """Refuse a damaged checkpoint before any of it is read, as training does (``sparsebalance_pl.checkpoints``)."""
    refusal = checkpoints.refusal(path)
    if refusal is not None:
        raise DataError(refusal)
    unverified = checkpoints.unverified(path)
    if unverified is not None:
        warnings.warn(unverified)


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path) -> Path:
    """Writes the checkpoint's model as a Hugging Face directory; returns the directory."""
    meta, weights = read_checkpoint(ckpt_path)
    if "hf_config" in meta:  # needs nothing but the checkpoint
        model = build_model(AutoConfig.for_model(**meta["hf_config"]), "sdpa")
    elif "model_dims" in meta:  # a checkpoint from when every model was a Qwen2 saved with its dimensions
        model = build_model(ModelDims(**meta["model_dims"]).to_hf_config("qwen2"), "sdpa")
    else:  # a checkpoint from before the dimensions were saved: rebuild from the run's model settings
        model_cfg = meta["hyper_parameters"]["model"]
        if not isinstance(model_cfg, ModelConfig):
            model_cfg = ModelConfig(**{k: v for k, v in model_cfg.items() if not k.startswith("_")})
        model = model_cfg.build("sdpa")
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ConfigError(f"{ckpt_path}: weights do not fit the model they were saved with: {err}") from err
    out = Path(out_dir)
    model.save_pretrained(out)
    return out

