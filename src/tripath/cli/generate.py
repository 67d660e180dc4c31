"""``tripath generate``: complete prompts with the engine and print the outputs and the run's metrics.

    tripath generate --model tiny-llama --prompt "Hello" --prompt "The sky is" --max-tokens 32
    tripath generate --model /models/Qwen3-8B --backend three_path --kv-cache-dtype fp8 --temperature 0.7
    tripath generate --model /models/Qwen3-32B --tensor-parallel-size 2 --prompt "Hello"

A model directory brings its tokenizer (``--tokenizer`` gives another); text prompts to a directory without
one are refused (exit 2): give ``--prompt-ids`` instead. Presets (random weights) have no tokenizer: their text
prompts are encoded as UTF-8 bytes (ids 0..255, which every preset's vocabulary covers) and decoded back the
same way.
``--prompt-ids`` passes token ids directly, ``--num-random-prompts N`` adds a fixed random workload (only
its metrics are printed), e.g. to compare ``--tensor-parallel-size`` 1 and 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from typing import Sequence

from tripath.cli.engine_options import HelpFormatter, add_engine_arguments, check_engine_arguments, engine_options

logger = logging.getLogger(__name__)


class ByteTokenizer:
    """UTF-8 bytes as token ids (the fallback for models without a tokenizer)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tripath generate", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a local Hugging Face model directory, a Hugging Face hub id (org/name) or a preset name")
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument("--prompt-ids", action="append", default=[],
                        help="a prompt as comma-separated token ids (repeatable)")
    parser.add_argument("--num-random-prompts", type=int, default=0,
                        help="add N prompts of random token ids (3..255, from --seed): a fixed workload to time")
    parser.add_argument("--random-prompt-len", type=int, default=128, help="tokens per random prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                        "whose probability reaches it")
    parser.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: all)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    add_engine_arguments(parser)
    return parser


def _parse_ids(text: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        parser.error(f"--prompt-ids expects comma-separated integers, got {text!r}")
    if not ids:
        parser.error("--prompt-ids got an empty list")
    return ids


def main_generate(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tripath generate``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    prompts: list = list(args.prompt) + [_parse_ids(p, parser) for p in args.prompt_ids]
    if args.num_random_prompts < 0 or args.random_prompt_len < 1:
        parser.error("--num-random-prompts must be >= 0 and --random-prompt-len >= 1")
    generator = random.Random(args.seed)
    prompts += [[generator.randrange(3, 256) for _ in range(args.random_prompt_len)]
                for _ in range(args.num_random_prompts)]
    if not prompts:
        parser.error("give at least one --prompt, --prompt-ids or --num-random-prompts")

    from tripath.engine import LLM, SamplingParams
    from tripath.engine.config import resolve_device, resolve_dtype
    from tripath.models.loader import TOKENIZER_FILES, load_config

    if args.prompt and os.path.isdir(args.model) and args.tokenizer is None:
        try:
            has_tokenizer = load_config(args.model).tokenizer_path is not None
        except (ValueError, TypeError, FileNotFoundError) as error:
            print(f"tripath generate: error: {error}", file=sys.stderr)
            return 2
        if not has_tokenizer:
            parser.error(f"--prompt: {args.model} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         "give the prompts as token ids with --prompt-ids")

    refused = check_engine_arguments(args)
    if refused is not None:
        parser.error(refused)
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, ignore_eos=args.ignore_eos)
        llm = LLM(args.model, tokenizer=args.tokenizer, **{**engine_options(args), "dtype": dtype, "device": device})
        with llm:
            if llm.tokenizer is None and llm.model.config.vocab_size >= 256:
                llm.tokenizer = ByteTokenizer()
                logger.info("%s is a preset without a tokenizer: text is encoded as UTF-8 bytes", args.model)
            outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as error:
        print(f"tripath generate: error: {error}", file=sys.stderr)
        return 2
    parallel = f" | tensor parallel {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    print(f"model {args.model} | backend {llm.backend_name} | {llm.runner.num_blocks} KV blocks of "
          f"{llm.runner.block_size} | {dtype} on {device}{parallel}")
    for i, out in enumerate(outputs[:len(outputs) - args.num_random_prompts]):
        prompt = out.prompt if out.prompt is not None else out.prompt_token_ids
        print(f"\n[{i}] prompt: {prompt!r}")
        if out.text is not None:
            print(f"[{i}] output: {out.text!r}")
        print(f"[{i}] tokens: {out.output_token_ids} ({out.finish_reason.value})")
    print("\n" + llm.last_metrics.summary())
    drafts = llm.stats().draft_summary()
    if drafts is not None:
        print(drafts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_generate())
