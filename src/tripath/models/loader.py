"""Loading models: from a Hugging Face directory (``config.json``, single or sharded ``*.safetensors``, the
tokenizer when present) — a local one, or a hub id's snapshot in the local Hugging Face cache or downloaded
(:mod:`tripath.models.hub`) — or from a preset with deterministic random weights.

Checkpoint tensors load by their Hugging Face names; per-expert MoE weights
``...mlp.experts.{e}.{gate,up,down}_proj.weight`` are stacked into ``[E, ...]`` parameters. Tensors of layers
past ``num_hidden_layers`` (DeepSeek's multi-token-prediction layers) and ``rotary_emb.inv_freq`` are skipped;
anything else unknown, missing, or of the wrong shape is an error that names the tensor. With ``mtp=True``
the first multi-token-prediction layer is loaded too, into ``model.mtp``
(:class:`~tripath.models.deepseek_mtp.DeepseekMTP`; a preset's gets random weights).

A tensor-parallel model (built with a :class:`~tripath.models.parallel.ParallelState` of several ranks) reads
only its rank's slices (``safe_open(...).get_slice(name)[...]``) and only its own experts; presets give each
rank the slices of the same random weights as the unsharded model.
"""

from __future__ import annotations

import gc
import json
import os
import re

import torch

from tripath.models.base import CausalLM
from tripath.models.config import ModelConfig, config_from_hf
from tripath.models.deepseek import DeepseekForCausalLM
from tripath.models.deepseek_mtp import DeepseekMTP, check_has_mtp
from tripath.models.hub import resolve_model_path
from tripath.models.layers import RMSNorm
from tripath.models.llama import LlamaForCausalLM
from tripath.models.parallel import SINGLE, ParallelState, model_shards
from tripath.models.presets import PRESETS

MODEL_CLASSES = {"llama": LlamaForCausalLM, "deepseek": DeepseekForCausalLM}
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"\.experts\.(gate_proj|up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def read_json(path: str) -> dict:
    """The JSON object in ``path``; ``ValueError`` naming the file when it is not valid UTF-8 JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a valid JSON file ({error})") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data


def load_config(path: str) -> ModelConfig:
    """The :class:`ModelConfig` of the Hugging Face model directory ``path``."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in {path}: a model directory needs config.json and *.safetensors")
    generation_path = os.path.join(path, "generation_config.json")
    generation = read_json(generation_path) if os.path.isfile(generation_path) else None
    has_tokenizer = any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)
    return config_from_hf(read_json(config_path), generation_config=generation,
                          tokenizer_path=path if has_tokenizer else None, source=config_path)


def build_model(config: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, device="cpu",
                parallel: ParallelState = SINGLE) -> CausalLM:
    """The model of ``config`` (the rank's shard under ``parallel``) with uninitialised parameters on
    ``device`` (load or initialise next)."""
    if dtype not in MODEL_DTYPES:
        raise TypeError(f"dtype={dtype} is not supported; supported: float16, bfloat16, float32")
    with torch.device("meta"):
        model = MODEL_CLASSES[config.family](config, dtype, parallel)
    device = torch.device(device)
    if device.type == "cuda":   # an engine the caller dropped may still hold the GPU through a reference cycle
        gc.collect()
        torch.cuda.empty_cache()
    model = model.to_empty(device=device)
    model.requires_grad_(False)
    return model.eval()


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's weight files: the shards of ``model.safetensors.index.json``, else every
    ``*.safetensors``."""
    index_path = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        shards = sorted(set(read_json(index_path).get("weight_map", {}).values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"{index_path} lists shards that are missing: {', '.join(missing)}")
        return [os.path.join(path, s) for s in shards]
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (pytorch_model.bin checkpoints are not "
                                "supported)")
    return files


def _open_safetensors(file: str):
    """``safe_open(file)``; ``ValueError`` naming the file when it is not a readable safetensors file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file}: not a readable safetensors file ({error})") from error


def _skipped(name: str, config: ModelConfig) -> bool:
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) >= config.num_layers:
        return True
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


def load_weights(model: CausalLM | DeepseekMTP, path: str) -> None:
    """Copy the checkpoint in ``path`` into ``model`` (converting dtypes), checking names and shapes. A
    :class:`DeepseekMTP` takes its own layer's tensors and skips the rest."""
    from safetensors import SafetensorError

    skipped = getattr(model, "checkpoint_skips", None) or (lambda name: _skipped(name, model.config))

    params = dict(model.named_parameters())
    shards = model_shards(model)
    expected, elsewhere = set(), set()  # elsewhere: other ranks' experts
    for name, p in params.items():
        if _STACKED.search(name):
            shard = shards.get(name)
            first, stop, total = (0, p.shape[0], p.shape[0]) if shard is None else (shard.start, shard.stop, shard.full)
            expected.update((name, e) for e in range(first, stop))
            elsewhere.update((name, e) for e in range(total) if not first <= e < stop)
        else:
            expected.add((name, None))
    loaded, unexpected = set(), []
    for file in safetensors_files(path):
        with _open_safetensors(file) as f:
            for name in f.keys():
                expert = _EXPERT.match(name)
                key = (f"{expert.group(1)}.{expert.group(3)}", int(expert.group(2))) if expert else (name, None)
                if key not in expected:
                    if key not in elsewhere and not skipped(name):
                        unexpected.append(name)
                    continue
                shard = shards.get(name) if key[1] is None else None
                if key[1] is None:
                    target = params[name]
                else:
                    stacked = shards.get(key[0])
                    target = params[key[0]][key[1] - (0 if stacked is None else stacked.start)]
                shape, want = tuple(f.get_slice(name).get_shape()), tuple(target.shape)
                if shard is not None:
                    want = shard.full_shape(want)
                if shape != want:
                    raise ValueError(f"{file}: tensor {name} has shape {shape}, but the config expects {want}")
                try:
                    if shard is None:
                        target.copy_(f.get_tensor(name))
                    else:
                        shard.copy_into(target, f.get_slice(name)[shard.index(len(shape))])
                except SafetensorError as error:
                    raise ValueError(f"{file}: cannot read tensor {name}: {error}") from error
                loaded.add(key)
    if unexpected:
        raise ValueError(f"{path}: the checkpoint has tensors this {model.config.architecture} config does not "
                         f"use: {', '.join(sorted(unexpected)[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    missing = sorted(expected - loaded, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    if missing:
        names = [n if e is None else "{0}.{2}.{1}.weight".format(*n.rsplit(".", 1), e) for n, e in missing]
        raise ValueError(f"{path}: the checkpoint lacks {len(names)} tensors the config needs: "
                         f"{', '.join(names[:8])}" + (" ..." if len(names) > 8 else ""))


def init_random_weights(model: CausalLM | DeepseekMTP, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights (same ``seed`` and device → same weights): RMSNorm weights 1, every other
    parameter ``N(0, std²)``. A sharded parameter draws its whole tensor and keeps its slice, so every rank
    holds the slices of the unsharded model's weights."""
    generator = torch.Generator(device=model.device).manual_seed(seed)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    shards = model_shards(model)
    for name, param in model.named_parameters():
        if id(param) in norms:
            param.fill_(1.0)
        elif name in shards:
            shard = shards[name]
            full = torch.empty(shard.full_shape(param.shape), dtype=param.dtype, device=param.device)
            shard.copy_into(param, full.normal_(0.0, std, generator=generator)[shard.index(full.dim())])
        else:
            param.normal_(0.0, std, generator=generator)


def build_mtp(config: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, device="cpu",
              parallel: ParallelState = SINGLE) -> DeepseekMTP:
    """The first multi-token-prediction layer of ``config`` (the rank's shard under ``parallel``) with
    uninitialised parameters on ``device``; :class:`~tripath.models.deepseek_mtp.NoMTPLayer` when the config
    has none."""
    check_has_mtp(config)
    with torch.device("meta"):
        mtp = DeepseekMTP(config, dtype, parallel)
    mtp = mtp.to_empty(device=torch.device(device))
    mtp.requires_grad_(False)
    return mtp.eval()


def load_model(path_or_preset: str, *, dtype: torch.dtype = torch.bfloat16, device="cpu", seed: int = 0,
               parallel: ParallelState = SINGLE, mtp: bool = False) -> CausalLM:
    """A model from a local Hugging Face directory, a Hugging Face hub id (from the local cache, or downloaded:
    :func:`~tripath.models.hub.resolve_model_path`) or a preset name (random weights from ``seed``); under
    ``parallel``, the rank's shard. ``mtp``: with its first multi-token-prediction layer as ``model.mtp``
    (DeepSeek checkpoints with ``num_nextn_predict_layers >= 1``; under ``parallel``, its shard too)."""
    path_or_preset = resolve_model_path(os.fspath(path_or_preset))
    if os.path.isdir(path_or_preset):
        config = load_config(path_or_preset)
        if mtp:
            check_has_mtp(config)   # before the weights load
        model = build_model(config, dtype=dtype, device=device, parallel=parallel)
        load_weights(model, path_or_preset)
        if mtp:
            model.mtp = build_mtp(config, dtype=dtype, device=device, parallel=parallel)
            load_weights(model.mtp, path_or_preset)
    elif path_or_preset in PRESETS:
        if mtp:
            check_has_mtp(PRESETS[path_or_preset]())
        model = build_model(PRESETS[path_or_preset](), dtype=dtype, device=device, parallel=parallel)
        init_random_weights(model, seed)
        if mtp:
            model.mtp = build_mtp(model.config, dtype=dtype, device=device, parallel=parallel)
            init_random_weights(model.mtp, seed + 1)
    elif os.path.exists(path_or_preset):
        raise FileNotFoundError(f"{path_or_preset} is a file: pass the model directory (with config.json)")
    else:  # resolve_model_path raised for anything else
        raise AssertionError(f"unresolved model name {path_or_preset!r}")
    model.post_load()
    return model


def load_tokenizer(model: CausalLM | str):
    """The tokenizer saved beside ``model`` (``transformers`` if it can load it, else a ``tokenizers``
    tokenizer from ``tokenizer.json``), or None when the model has none (presets, weight-only directories).
    ``model`` may also be a tokenizer's directory or Hugging Face hub id (its tokenizer files only are
    fetched); one without tokenizer files is a ``FileNotFoundError``."""
    if isinstance(model, (str, os.PathLike)):
        path = resolve_model_path(os.fspath(model), weights=False)
        if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
            raise FileNotFoundError(f"{os.fspath(model)!r} holds no tokenizer (none of "
                                    f"{', '.join(TOKENIZER_FILES)})")
    else:
        path = model.config.tokenizer_path
    if path is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (ImportError, OSError, ValueError, KeyError) as error:
        tokenizer_json = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_json):
            raise RuntimeError(f"cannot load the tokenizer in {path}: {error}") from error
        from tokenizers import Tokenizer

        return Tokenizer.from_file(tokenizer_json)
