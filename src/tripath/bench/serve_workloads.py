"""The workloads of ``tripath bench serve``: requests of random token ids, their lengths and concurrency.

A :class:`Workload` names a model (preset or Hugging Face directory), the backends to compare and the
requests; :data:`WORKLOADS` are the built-in ones (``--workload``), whose fields the command's options
override; :func:`make_prompts` draws a pass's prompts from a seed.
"""

from __future__ import annotations

import random
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """Requests of random tokens (``ignore_eos``): ``input_len`` ± ``input_len_spread`` (a fraction, uniform),
    ``output_len`` outputs, at most ``max_concurrency`` in flight; ``prefix_share`` of every prompt is one
    prefix common to all requests (prefix-cache hits turn their prefills into extends)."""

    model: str
    backends: tuple[str, ...]
    num_requests: int
    input_len: int
    input_len_spread: float
    output_len: int
    max_concurrency: int
    prefix_share: float = 0.0
    max_num_batched_tokens: int = 8192
    description: str = ""
    logprobs: int | None = None       # top log-probabilities each asking request gets per token
    logprobs_fraction: float = 0.0    # share of the requests asking for them (evenly spread)

    def __post_init__(self):
        if self.num_requests < 1 or self.input_len < 1 or self.output_len < 1 or self.max_concurrency < 1:
            raise ValueError("num_requests, input_len, output_len and max_concurrency must be >= 1")
        if not 0 <= self.input_len_spread < 1:
            raise ValueError(f"input_len_spread must be in [0, 1), got {self.input_len_spread}")
        if not 0 <= self.prefix_share < 1:
            raise ValueError(f"prefix_share must be in [0, 1), got {self.prefix_share}")
        if not 0 <= self.logprobs_fraction <= 1:
            raise ValueError(f"logprobs_fraction must be in [0, 1], got {self.logprobs_fraction}")
        if self.logprobs_fraction > 0 and self.logprobs is None:
            raise ValueError("logprobs_fraction needs logprobs (the number of top log-probabilities)")

    def asks_logprobs(self, index: int) -> bool:
        """Whether request ``index`` asks for log-probabilities (``logprobs_fraction`` of them, evenly)."""
        f = self.logprobs_fraction
        return int((index + 1) * f) > int(index * f)

    @property
    def max_input_len(self) -> int:
        return int(self.input_len * (1 + self.input_len_spread))

    @property
    def max_model_len(self) -> int:
        return self.max_input_len + self.output_len


MHA = ("three_path", "unified", "two_path", "mixed")
MLA = ("mla", "mla_triton")
WORKLOADS = {
    "mha-tp8": Workload("qwen3-235b-attn-tp8", MHA, 256, 2048, 0.5, 512, 64,
                        description="Qwen3-235B attention at TP 8, 64 concurrent, 1-3K in, 512 out"),
    "mla-tp8": Workload("deepseek-r1-attn-tp8", MLA, 256, 2048, 0.5, 512, 64,
                        description="DeepSeek-R1 MLA at TP 8, 64 concurrent, 1-3K in, 512 out"),
    "llama-8b": Workload("llama-3.1-8b", MHA, 128, 1024, 0.5, 256, 128,
                         description="Llama-3.1-8B, 128 requests, 0.5-1.5K in, 256 out"),
    "long": Workload("llama-3.1-8b", MHA, 16, 32768, 0.1, 128, 16,
                     description="Llama-3.1-8B, 16 requests of about 32K (chunked prefill: extends on long contexts)"),
    "tiny": Workload("tiny-llama", ("three_path", "torch"), 8, 48, 0.5, 8, 4, prefix_share=0.25,
                     max_num_batched_tokens=64, description="a CPU-sized check that the benchmark runs"),
}


def make_prompts(workload: Workload, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_requests`` prompts of random token ids in ``[2, vocab_size)``, reproducible from ``seed``."""
    rng = random.Random(seed)
    low = max(1, int(workload.input_len * (1 - workload.input_len_spread)))
    high = max(low, workload.max_input_len)
    prefix = [rng.randrange(2, vocab_size) for _ in range(int(workload.input_len * workload.prefix_share))]
    prompts = []
    for _ in range(workload.num_requests):
        n = rng.randint(low, high)
        head = prefix[:max(0, n - 1)]
        prompts.append(head + [rng.randrange(2, vocab_size) for _ in range(n - len(head))])
    return prompts


WORKLOAD_OPTIONS = ("model", "num_requests", "input_len", "input_len_spread", "output_len", "max_concurrency",
                    "prefix_share", "max_num_batched_tokens", "logprobs", "logprobs_fraction")


def workload_from_args(args, fields: tuple[str, ...] = WORKLOAD_OPTIONS) -> Workload:
    """The built-in ``args.workload`` with the ``fields`` that ``args`` sets overridden (and ``args.backends``
    where it has them)."""
    if args.workload not in WORKLOADS:
        raise SystemExit(f"tripath bench serve: unknown --workload {args.workload!r}; built in: {', '.join(WORKLOADS)}")
    base = WORKLOADS[args.workload]
    overrides = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    if getattr(args, "logprobs", None) is not None and getattr(args, "logprobs_fraction", None) is None:
        overrides["logprobs_fraction"] = 1.0
    if getattr(args, "backends", None):
        overrides["backends"] = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as err:
        raise SystemExit(f"tripath bench serve: {err}") from None
