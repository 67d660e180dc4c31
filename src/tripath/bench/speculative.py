"""Speculative decoding's speed against its acceptance: ``tripath bench speculative``.

No trained draft is needed: the drafts come from an *oracle* (:class:`~tripath.engine.speculative.oracle.
OracleProposer`) that replays the greedy run of the same prompts recorded without speculation and replaces
each drafted token with another with probability ``1 - p``. So random weights of a real model's shapes give
the verify steps of that model at a chosen acceptance. Random weights leave many of a greedy run's
logits nearly tied, and a verify step computes its rows with other kernels than a decode step, so some ties
break the other way and the drafts turn wrong from there (more often the larger the batch). So by default a
preset's weights are made *counting* (:func:`count_up`): the greedy token after ``t`` is ``t + 1``, by a margin
no kernel's rounding reaches; every weight keeps its shape, so every step does the work it does with the
preset's random weights. ``--weights random`` keeps those. With ``--method mtp`` (a model with a
multi-token-prediction layer: ``deepseek-r1-attn-tp8``, ``tiny-deepseek``) the MTP layer runs as it would —
over every step's tokens, and ``k`` times to draft — and the oracle's tokens replace its drafts
(:class:`~tripath.engine.speculative.oracle.SteeredProposer`), so the times include the MTP layer's work at the
oracle's acceptance.

For each ``--batch-sizes`` entry ``B``, ``B`` greedy requests of ``--input-len`` random tokens and
``--output-len`` outputs run at once:

1. on the engine with its defaults (no speculation): the baseline's TPOT (mean time per output token after
   the first) and output tok/s, and its outputs;
2. on an engine with ``num_speculative_tokens = --num-speculative-tokens``: the *reference* run, the
   speculating engine's own greedy outputs, drafted from the baseline's with every draft right. A verify
   step's rows are computed by other kernels than a decode step's (other GEMM shapes, the verify attention),
   so where two logits of a bf16 model nearly tie the two engines may take different tokens, and the
   baseline's outputs from there on would be wrong drafts. Greedy verification keeps exactly the target's
   tokens, so the oracle replays the reference; ``reference_same_as_baseline`` is the share of its outputs
   equal to the baseline's;
3. for each ``--acceptance`` ``p``: TPOT, output tok/s, their ratio to the baseline, and of the measured run
   its acceptance (drafts kept / drafted), tokens per verify step, the tokens drafted, and the share of
   outputs equal to the reference. With ``--weights random`` that share falls below 1.0 where another
   acceptance changes a step's shapes enough to break a near-tie the other way (adaptive draft lengths, large
   batches); from the first such token on, the request's drafts are wrong, so the measured acceptance, not
   ``p``, is what the row ran at.
   ``--acceptance-threshold`` turns on adaptive draft lengths (:mod:`tripath.engine.speculative.draft_length`),
   learned afresh for each row (its unmeasured run first, then the measured one).

Both engines run without prefix caching: a prompt computed again from cached blocks would take other
kernels than its prefill (an extend of its last tokens), another source of near-ties broken the other way.

Each measured run follows an unmeasured one of the same shapes (compilation, caches). One engine at a time
holds the device. ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tripath bench speculative", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b", help="preset or model directory")
    parser.add_argument("--batch-sizes", default="1,8,32", help="requests at once, comma-separated")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--tree-width", type=int, default=1,
                        help="draft trees of this many branches (ngram; the oracle's recorded branch and "
                             "corrupted siblings); 1: chains")
    parser.add_argument("--method", choices=("ngram", "mtp"), default="ngram",
                        help="the speculating engine's method; its drafts are the oracle's either way (mtp: the "
                             "model's MTP layer runs and is timed)")
    parser.add_argument("--acceptance-threshold", type=float, default=0.0,
                        help="speculative_config acceptance_threshold: adaptive draft lengths (0: off)")
    parser.add_argument("--acceptance", default="0,0.5,0.7,0.9",
                        help="chances p that a drafted token is the recorded one, comma-separated")
    parser.add_argument("--weights", choices=("auto", "counting", "random"), default="auto",
                        help="a preset's weights: counting (greedy token t + 1 after t, by a wide margin: "
                             "acceptance stays the oracle's at any batch) or its random ones; auto: counting "
                             "for a preset with an untied LM head, else its own weights")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--num-kv-blocks", type=int, help="KV cache blocks (default: the engine's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows to this file")
    return parser


def _engine(args, speculative: int | None):
    from tripath.engine import LLM

    # no prefix caching (module doc): every run prefills its prompts as the recorded ones did
    options = dict(backend=args.backend, device=args.device, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
                   enable_prefix_caching=False)
    if speculative:
        options["speculative_config"] = {"method": args.method, "num_speculative_tokens": speculative}
        if getattr(args, "tree_width", 1) > 1:
            options["speculative_config"]["tree_width"] = args.tree_width
        if getattr(args, "acceptance_threshold", 0.0) > 0:
            options["speculative_config"]["acceptance_threshold"] = args.acceptance_threshold
    llm = LLM(args.model, **{k: v for k, v in options.items() if v is not None})
    if _counting(args):
        count_up(llm.model)
    return llm


COUNTING_EMBEDDING_RMS = 256.0
"""The RMS :func:`count_up` gives the embedding's rows: about a hundred times what a decoder layer of the
presets adds to the residual stream (random weights of standard deviation 0.02), so the stream keeps the
token's direction through every layer."""


def _counting(args) -> bool:
    from tripath.models.presets import PRESETS

    if args.weights == "auto":   # a preset's, where it has an LM head of its own
        return args.model in PRESETS and not PRESETS[args.model]().tie_word_embeddings
    if args.weights == "counting" and args.model not in PRESETS:
        raise ValueError(f"--weights counting rewrites a preset's random weights; {args.model!r} is not a preset "
                         f"(--weights auto keeps a model directory's own)")
    return args.weights == "counting"


@torch.no_grad()
def count_up(model) -> None:
    """Rewrite a model's embedding and LM head in place so that its greedy next token after ``t`` is
    ``t + 1`` (``vocab_size - 1`` is followed by 0), whatever its decoder layers hold: the LM head's row
    ``v`` becomes the embedding's row ``v - 1``, then the embedding's rows are scaled to an RMS of
    :data:`COUNTING_EMBEDDING_RMS`. The residual stream is then the current token's row plus the layers'
    comparatively small outputs, the final norm keeps its direction, and the LM head's row for ``t + 1`` meets
    it at a cosine near 1 where every other row's is about ``1 / sqrt(hidden_size)``. Shapes, and so each
    step's work, are unchanged. Needs an untied LM head holding the whole vocabulary (one rank)."""
    embed = model.model.embed_tokens.weight
    if model.lm_head is None:
        raise ValueError("count_up needs an LM head apart from the embedding; this model ties them")
    head = model.lm_head.weight
    if head.shape != embed.shape:
        raise ValueError(f"count_up needs the whole vocabulary on one rank; the LM head holds {tuple(head.shape)} "
                         f"and the embedding {tuple(embed.shape)}")
    head.copy_(torch.roll(embed, 1, dims=0))
    embed.mul_(COUNTING_EMBEDDING_RMS / embed.float().pow(2).mean().sqrt().item())


def _greedy(llm, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """One greedy run of ``prompts`` (``output_len`` tokens each, no stop): the outputs' token ids."""
    from tripath.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _run(llm, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], dict]:
    """Warm run, then the measured one: ``(outputs, {tpot_ms, output_tok_s, elapsed_s, drafts,
    draft_tokens, accepted})``, the last three the measured run's verifies, drafted and kept tokens."""
    _greedy(llm, prompts, output_len)
    before = llm.stats()
    outputs = _greedy(llm, prompts, output_len)
    after, metrics = llm.stats(), llm.last_metrics
    return outputs, dict(tpot_ms=metrics.mean_tpot_s * 1e3, output_tok_s=metrics.output_throughput,
                         elapsed_s=metrics.elapsed_s, drafts=after.spec_num_drafts - before.spec_num_drafts,
                         draft_tokens=after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                         accepted=after.spec_num_accepted_tokens - before.spec_num_accepted_tokens)


def _free_device() -> None:
    """Return the memory of the engines no longer referenced to the device, before the next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args) -> list[dict]:
    from tripath.engine.speculative.draft_length import DraftLengths
    from tripath.engine.speculative.oracle import OracleProposer, SteeredProposer

    _counting(args)   # a bad --weights fails before any engine loads
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    chances = [float(p) for p in args.acceptance.split(",")]
    llm = _engine(args, None)
    vocab = int(llm.model.config.vocab_size)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = {b: [torch.randint(10, vocab, (args.input_len,), generator=gen).tolist() for _ in range(b)]
               for b in batch_sizes}
    baseline, recorded = {}, {}
    for b in batch_sizes:
        recorded[b], baseline[b] = _run(llm, prompts[b], args.output_len)
    llm.close()
    llm = None   # the baseline's memory goes back before the speculating engine loads
    _free_device()
    llm = _engine(args, args.num_speculative_tokens)
    drafter = llm.scheduler.proposer   # mtp: runs, its drafts replaced by the oracle's

    def propose(b: int, record: list[list[int]], p: float) -> None:
        oracle = OracleProposer({tuple(x): y for x, y in zip(prompts[b], record)}, p, vocab, args.seed)
        llm.scheduler.proposer = SteeredProposer(drafter, oracle) if args.method == "mtp" else oracle
        if llm.scheduler.draft_lengths is not None:   # each row learns its own acceptance from the first prior
            llm.scheduler.draft_lengths = DraftLengths(args.acceptance_threshold)

    rows = []
    for b in batch_sizes:
        propose(b, recorded[b], 1.0)
        reference = _greedy(llm, prompts[b], args.output_len)
        agree = sum(r == x for r, x in zip(reference, recorded[b])) / b
        for p in chances:
            propose(b, reference, p)
            outputs, measured = _run(llm, prompts[b], args.output_len)
            drafted, accepted, verifies = measured.pop("draft_tokens"), measured.pop("accepted"), measured.pop("drafts")
            same = sum(o == r for o, r in zip(outputs, reference)) / b
            rows.append(dict(batch=b, p=p, **measured, baseline_tpot_ms=baseline[b]["tpot_ms"],
                             baseline_output_tok_s=baseline[b]["output_tok_s"],
                             tpot_speedup=baseline[b]["tpot_ms"] / measured["tpot_ms"] if measured["tpot_ms"] else 0.0,
                             acceptance=accepted / drafted if drafted else 0.0,
                             tokens_per_verify=1 + accepted / verifies if verifies else 1.0,
                             draft_tokens=drafted, same_outputs=same, reference_same_as_baseline=agree))
    llm.close()
    llm = None
    _free_device()
    return rows


def print_rows(rows: list[dict], args) -> None:
    print(f"{args.model}: {args.input_len} prompt + {args.output_len} output tokens per request, "
          f"{args.num_speculative_tokens} drafted tokens per verify (oracle drafts"
          + (", the MTP layer running)" if args.method == "mtp" else ")")
          + (", counting weights" if _counting(args) else ""))
    print(f"{'batch':>5} {'p':>5} {'TPOT ms':>9} {'base ms':>9} {'speed-up':>8} {'tok/s':>9} {'base tok/s':>10} "
          f"{'accepted':>8} {'tok/verify':>10} {'drafted':>8} {'same out':>8} {'ref=base':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['p']:>5.2f} {r['tpot_ms']:>9.3f} {r['baseline_tpot_ms']:>9.3f} "
              f"{r['tpot_speedup']:>7.2f}x {r['output_tok_s']:>9.1f} {r['baseline_output_tok_s']:>10.1f} "
              f"{r['acceptance']:>8.1%} {r['tokens_per_verify']:>10.2f} {r['draft_tokens']:>8} "
              f"{r['same_outputs']:>8.0%} {r['reference_same_as_baseline']:>8.0%}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rows = run(args)
    print_rows(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
