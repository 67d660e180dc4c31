"""Speculative decoding's settings (:class:`SpeculativeConfig`), given as vLLM takes them: a dict or its JSON
text, ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}``.

Methods: ``ngram`` — prompt lookup (:mod:`tripath.engine.speculative.ngram`): no weights, the drafts are the
tokens that followed the latest earlier occurrence of the request's last ``n`` tokens, for the largest ``n``
in ``[prompt_lookup_min, prompt_lookup_max]`` that occurs; ``draft_model`` — a smaller ``model`` with the
target's vocabulary drafts greedily (:mod:`tripath.engine.drafters.draft_model`; under tensor parallelism
unsharded, beside rank 0's shard); ``mtp``
(alias ``deepseek_mtp``, vLLM's name) — the target's own multi-token-prediction layer drafts greedily
(:mod:`tripath.engine.drafters.mtp`; DeepSeek checkpoints with ``num_nextn_predict_layers >= 1``; under
tensor parallelism every rank runs its shard of the layer). Without a method, a ``model`` means ``draft_model``. Every error names the key and what is allowed.

Draft trees (opt-in): ``tree_width`` ``w >= 2`` (``ngram`` only) drafts up to ``w`` alternative continuations
per request, merged by common prefix into a tree of at most ``num_speculative_tokens`` nodes, and verifies
the whole tree in one step (:mod:`tripath.engine.speculative.trees`); ``w = 1`` (the default) drafts a chain.
Trees need a backend whose verify route takes a draft tree's mask (``three_path``, ``torch``; for MLA models
``mla``, ``mla_triton``, ``torch``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model", "mtp")
ALIASES = {"deepseek_mtp": "mtp"}   # vLLM's names of the same methods
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator")
TREE_METHODS = ("ngram",)   # the methods whose proposer drafts trees (tree_width > 1)
MAX_SPECULATIVE_TOKENS = 15   # a verify step feeds at most 16 query tokens per request


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` (1–15): tokens drafted per request and step; ``prompt_lookup_max`` /
    ``prompt_lookup_min``: the longest and shortest suffix the n-gram method looks up (defaults 4 and 1);
    ``model``: the draft model (``draft_model``); ``draft_tensor_parallel_size``: 1 or None (vLLM's key: the
    draft runs on one rank);
    ``tree_width`` (1–``num_speculative_tokens``): the most branches of a request's draft tree (1: a chain);
    ``acceptance_threshold`` (in ``[0, 1)``; 0, the default: off): each request drafts only the tokens whose
    estimated chance of being kept is at least this (:mod:`tripath.engine.speculative.draft_length`);
    ``disable_by_batch_size`` (vLLM's key; None: off): no request drafts while more requests than this run."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    tree_width: int = 1
    acceptance_threshold: float = 0.0
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        if self.method in ALIASES:
            object.__setattr__(self, "method", ALIASES[self.method])
        if self.method in NOT_YET:
            raise ValueError(f"speculative_config method {self.method!r} is not available in this version; "
                             f"supported: {', '.join(METHODS)}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is unknown; supported: {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "tree_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"speculative_config {name} must be an int, got {value!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if not 1 <= self.tree_width <= self.num_speculative_tokens:
            raise ValueError(f"speculative_config tree_width must be in [1, num_speculative_tokens="
                             f"{self.num_speculative_tokens}] (branches of a draft tree of at most that many "
                             f"tokens), got {self.tree_width}")
        if self.tree_width > 1 and self.method not in TREE_METHODS:
            raise ValueError(f"speculative_config tree_width={self.tree_width} (draft trees) is not supported by "
                             f"method {self.method!r}; methods with draft trees: {', '.join(TREE_METHODS)}")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError("speculative_config method 'draft_model' needs model (a preset, model directory or "
                             "hub id of a smaller model with the target's tokenizer)")
        if self.method in ("ngram", "mtp") and self.model is not None:
            raise ValueError(f"speculative_config model={self.model!r} is for method 'draft_model'; the "
                             f"{self.method} method takes no model" +
                             (" (it drafts with the target's own MTP layer)" if self.method == "mtp" else ""))
        threshold = self.acceptance_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
            raise ValueError(f"speculative_config acceptance_threshold must be a number in [0, 1) (the least chance "
                             f"of being kept a draft is worth; 0: always draft num_speculative_tokens), got "
                             f"{threshold!r}")
        object.__setattr__(self, "acceptance_threshold", float(threshold))
        limit = self.disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be an int >= 1 or None, got {limit!r}")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"speculative_config draft_tensor_parallel_size must be 1 (the draft model runs on "
                             f"one rank), got {self.draft_tensor_parallel_size!r}")

    @property
    def needs_target_hidden(self) -> bool:
        """Whether the proposer reads the target's hidden states (``mtp``): every launch hands them on."""
        return self.method == "mtp"

    @property
    def uses_trees(self) -> bool:
        """Whether requests draft trees (``tree_width > 1``), not chains."""
        return self.tree_width > 1

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """``value``: None (off), a :class:`SpeculativeConfig`, a dict, or a dict's JSON text."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict (or its JSON text), got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (tokens drafted per step)")
        if value.get("method") is None:   # as vLLM: a model means a draft model, else n-gram lookup
            value = {**value, "method": "draft_model" if value.get("model") else "ngram"}
        return cls(**value)
