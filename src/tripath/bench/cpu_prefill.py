"""``tripath bench cpu-prefill MODEL_DIR``: a long prompt's prefill on the CPU through the engine — each CPU
attention backend (``sdpa``, the default there, and the ``torch`` reference) with the engine's step pacing
(``--step-time-target``; default the engine's) — against transformers' own forward
(``attn_implementation="sdpa"``) on the same prompt, same threads, float32. Each is timed ``--repeats`` times after a warm-up; the median is reported, and the first
token each produces, which should agree.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _prompt(length: int, vocab_size: int) -> list[int]:
    """Token ids spread over the vocabulary (past its first few, often special, ids)."""
    return [(i * 7919) % (vocab_size - 8) + 8 for i in range(length)]


def _time(run, repeats: int) -> tuple[float, int]:
    run()
    times, token = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        token = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), token


def _engine(model: str, backend: str, prompt: list[int], repeats: int, step_time_target: float | None):
    from tripath.engine import LLM, SamplingParams

    llm = LLM(model, backend=backend, device="cpu", max_model_len=len(prompt) + 16, enable_prefix_caching=False,
              step_time_target_s=step_time_target)
    params = SamplingParams(max_tokens=1, temperature=0)
    return _time(lambda: llm.generate([prompt], params, use_tqdm=False)[0].output_token_ids[0], repeats)


def _transformers(model: str, prompt: list[int], repeats: int):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.tensor([prompt])

    def run():
        with torch.no_grad():
            return int(hf(ids).logits[0, -1].argmax())

    return _time(run, repeats)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tripath bench cpu-prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face model directory")
    parser.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--step-time-target", type=float, default=None, metavar="SECONDS",
                        help="the engine's step pacing (default: the engine's, 0.5 s on the CPU; 0: off, the prompt "
                             "in one step)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    prompt = _prompt(args.prompt_len, AutoConfig.from_pretrained(args.model).vocab_size)
    rows = [("transformers (sdpa)", *_transformers(args.model, prompt, args.repeats))]
    for backend in ("sdpa", "torch"):
        rows.append((f"tripath {backend}", *_engine(args.model, backend, prompt, args.repeats, args.step_time_target)))
    base = rows[0][1]
    pacing = "default" if args.step_time_target is None else f"{args.step_time_target:g} s"
    print(f"prefill of {args.prompt_len} tokens on the CPU, {torch.get_num_threads()} threads, float32, step pacing "
          f"{pacing}, median of {args.repeats}")
    print(f"{'':24}{'seconds':>9}{'tokens/s':>10}{'vs transformers':>17}{'first token':>13}")
    for name, seconds, token in rows:
        print(f"{name:24}{seconds:9.2f}{args.prompt_len / seconds:10.0f}{base / seconds:16.2f}x{token:13d}")
    return 0
