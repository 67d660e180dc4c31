"""Sampling defaults from a model's ``generation_config.json``, as vLLM's ``--generation-config`` reads them.

``source``: ``"auto"`` reads the model directory's ``generation_config.json`` (no file: no defaults),
``"vllm"`` ignores it (the engine's own defaults), any other value is a folder holding a
``generation_config.json`` (which must exist). Of the file, the sampling fields ``temperature``, ``top_p``,
``top_k``, ``repetition_penalty``, ``min_p`` and ``max_new_tokens`` (as ``max_tokens``) are taken, keyed by
:class:`~tripath.engine.requests.sampling_params.SamplingParams` field names; as in vLLM, a value equal to the
default of ``transformers``' ``GenerationConfig`` (temperature 1, top_p 1, top_k 50, repetition_penalty 1) is
not taken, and ``do_sample`` is ignored. They are the defaults of requests that leave those fields unset.

The loader returns every such field, whether or not the engine implements it; :func:`usable_defaults` keeps
those that ``SamplingParams`` has, at the point of use.
"""

from __future__ import annotations

import dataclasses
import numbers
import os

from tripath.engine.requests.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> (SamplingParams field, transformers' GenerationConfig default)
SAMPLING_KEYS = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0), "top_k": ("top_k", 50),
                 "repetition_penalty": ("repetition_penalty", 1.0), "min_p": ("min_p", None),
                 "max_new_tokens": ("max_tokens", None)}
INTEGER_KEYS = ("top_k", "max_new_tokens")


def load_generation_defaults(model_dir: str | None, source: str = "auto") -> dict[str, float | int]:
    """The sampling defaults of ``source`` (``"auto"``: the ``generation_config.json`` in ``model_dir``, which
    may be None for a model without a directory; ``"vllm"``: none; else a folder holding one), keyed by
    ``SamplingParams`` field names. Raises ``FileNotFoundError`` for a folder without the file and
    ``ValueError`` naming the file and key for a value of the wrong type."""
    if not isinstance(source, str) or not source:
        raise TypeError(f"generation_config must be 'auto', 'vllm' or a folder, got {source!r}")
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else source
    if folder is None or not os.path.isdir(folder):
        if source == "auto":
            return {}
        raise FileNotFoundError(f"generation_config {source!r} is not a folder (pass 'auto', 'vllm' or a folder "
                                f"holding {GENERATION_CONFIG_FILE})")
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        if source == "auto":
            return {}
        raise FileNotFoundError(f"generation_config {source!r} holds no {GENERATION_CONFIG_FILE}")
    from tripath.models.loader import read_json   # a JSON object, or ValueError naming the file

    raw = read_json(path)
    defaults: dict[str, float | int] = {}
    for key, (field, neutral) in SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None or value == neutral:
            continue
        kind = numbers.Integral if key in INTEGER_KEYS else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{path}: {key} must be {'an integer' if key in INTEGER_KEYS else 'a number'}, "
                             f"got {value!r}")
        defaults[field] = value
    return defaults


def usable_defaults(defaults: dict[str, float | int]) -> dict[str, float | int]:
    """The entries of ``defaults`` that are :class:`SamplingParams` fields (the others: not implemented)."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    return {name: value for name, value in defaults.items() if name in fields}
