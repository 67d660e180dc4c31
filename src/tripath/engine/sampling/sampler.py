"""Next-token sampling: greedy, temperature, min-p, top-k, top-p, with a generator per request.

For a row of logits ``z [V]`` with temperature ``t > 0``: ``p = softmax(z / t)`` restricted to the tokens at
least ``min_p`` times as likely as the most likely one, then to the ``k`` most likely tokens (ties at the k-th value kept) and then to the smallest most-likely-first set whose mass
reaches ``top_p`` (the most likely token always stays), renormalised. The token is drawn with the
exponential race ``argmax_i p_i / e_i``, ``e_i ~ Exp(1)`` from the request's own generator — the same law as
a categorical draw, and it makes each request's tokens independent of the rest of the batch (a preempted,
recomputed request continues with exactly the tokens it would have had). ``t = 0`` is ``argmax z``; a tiny
positive ``t`` samples among the tokens tied at the max (``z - max z`` is divided, so nothing overflows).

Rows with a temperature alone (nothing cut: :attr:`SamplingParams.plain_temperature`) are drawn instead, when
the caller passes each row's noise key ``(seed, position)`` (the engine does), by Gumbel-max with
counter-based noise (:func:`tripath.ops.lm_head_sample.logits_sample`): the token of the largest
``z + t · G(seed, position, token)``, the same law, one pass over the logits (no sort), and the same draw as
the LM head's fused path (:mod:`tripath.engine.sampling.fused_sampling`) makes without writing the logits. A token
then depends only on the request's seed and the position, not on the batch, on the path or on earlier
draws; the request's generator is not used. A positive ``t`` so small that ``t · G`` vanishes next to ``z``
is greedy there (the lowest id among tied maxima).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tripath.attention.step_ints import to_device
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.sampling.logits_transforms import StepTransforms
from tripath.ops.lm_head_sample import logits_sample


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, V]`` float32 probabilities after temperature, min-p, top-k and top-p (rows of ``logits [N, V]``,
    any float dtype; ``temperature [N] > 0``, ``top_k [N]`` int64 with values < 1 meaning no limit, ``top_p
    [N]`` in (0, 1], ``min_p [N]`` in [0, 1]: tokens less likely than ``min_p`` times the most likely one
    are dropped)."""
    vocab = logits.shape[-1]
    # Shifted by the row's max before the division, so a tiny temperature sends every other logit to -inf
    # (or a very negative number) rather than overflowing the max to inf: it stays finite, ``0 / t = 0``,
    # and the sampling tends to greedy. The clamp keeps a temperature that underflows in fp32 from giving
    # ``0 / 0`` on the max.
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
    scaled = shifted / temperature.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    if min_p is not None:   # p_i < min_p * p_max  <=>  z_i / t < z_max / t + log(min_p)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < sorted_logits[:, :1] + min_p.log()[:, None],
                                                  float("-inf"))
    k = torch.where(top_k < 1, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           transforms: StepTransforms | None = None, step: int = 0,
           noise: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One token per row of ``logits [N, V]`` for requests with ``params[i]`` and ``generators[i]`` (a
    generator on the logits' device; None draws from the global one). Returns ``[N]`` int64. The logits may
    be of any float dtype: greedy rows take their argmax as they are (the same token as in float32), the
    other rows are filtered and drawn in float32. ``transforms``: the rows' ``min_tokens``, ``logit_bias``
    and penalties (:mod:`tripath.engine.sampling.logits_transforms`) for model step ``step`` of a launch, applied to a
    float32 copy first; the sampled tokens are then counted for the penalties. ``noise``: ``(seeds [N],
    positions [N])`` int64 on the logits' device, the rows' noise keys: plain-temperature rows are then drawn
    by Gumbel-max with them (see the module doc), else by the exponential race with their generators."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_requests, vocab], got shape {tuple(logits.shape)}")
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"params ({len(params)}) and generators ({len(generators)}) must have one entry per "
                         f"row of logits ({logits.shape[0]})")
    if transforms is not None:
        logits = transforms.apply(logits, step)
    tokens = _draw(logits, params, generators, noise)
    if transforms is not None:
        transforms.record(tokens)
    return tokens


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
          noise: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    device = logits.device
    if noise is not None:
        plain = [i for i in rows if params[i].plain_temperature]
        if plain:
            rows = [i for i in rows if not params[i].plain_temperature]
            pick = to_device(plain, torch.int64, device)
            temperature = to_device([params[i].temperature for i in plain], torch.float32, device)
            seeds, positions = noise
            tokens[pick] = logits_sample(logits.index_select(0, pick), temperature, seeds.index_select(0, pick),
                                         positions.index_select(0, pick)).tokens
            if not rows:
                return tokens
    pick = to_device(rows, torch.int64, device)
    temperature = to_device([params[i].temperature for i in rows], torch.float32, device)
    top_k = to_device([params[i].top_k for i in rows], torch.int64, device)
    top_p = to_device([params[i].top_p for i in rows], torch.float32, device)
    min_p = None
    if any(params[i].min_p > 0 for i in rows):
        min_p = to_device([params[i].min_p for i in rows], torch.float32, device)
    probs = filtered_probs(logits[pick], temperature, top_k, top_p, min_p)
    noise = torch.empty_like(probs)
    for j, i in enumerate(rows):
        noise[j].exponential_(generator=generators[i])
    noise.clamp_(min=torch.finfo(torch.float32).tiny)  # a zero draw would make 0 / 0 for a cut token
    tokens[pick] = (probs / noise).argmax(dim=-1)
    return tokens


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return generator
