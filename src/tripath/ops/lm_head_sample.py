"""The next token of a few rows straight from their hidden states: the LM head and the draw in one pass over the
vocabulary, without writing ``[M, V]`` logits (:mod:`tripath.kernels.lm_head_sample` has the math).

For rows ``hidden [M, K]`` and the LM head's rows ``weight [V, K]``: ``z = dtype(hidden · weightᵀ)`` (the
logits the LM head would write, in its dtype), and per row

- greedy (``temperature`` None, or 0 in a row): the token of the largest ``z``, the lowest id among ties
  (as ``torch.argmax``);
- ``temperature t > 0``: the token of the largest ``z + t · G``, ``G`` standard Gumbel noise from Philox keyed
  by the row's ``seed`` and counted by (token id, ``position``): a draw from ``softmax(z / t)``, the same for
  a (seed, position) whatever else the batch holds, whichever rank holds the token and whichever path
  (:func:`lm_head_sample`, :func:`logits_sample`, their references) computes it — up to the last bit of the
  logits and of ``log`` (PyTorch's and the GPU's ``log`` may differ by an ulp, which changes a draw only
  where two keys agree to that ulp).

Each call returns a :class:`SampleDraw`: the tokens, their keys and logits, and each row's log-sum-exp of
``z``, so the token's log-probability (``log_softmax(z)`` at it) comes without the logits. Under tensor
parallelism each rank draws from its vocabulary rows (``vocab_offset``: their first id) and
:func:`merge_draws` combines the ranks' draws (``[W, M, 4]`` values, not logits) into the draw over the
whole vocabulary: the largest key (the lowest rank among equals, whose ids are lower) and the LSE of the LSEs.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

import torch

from tripath.kernels.lm_head_sample import lm_head_sample_kernel, logits_sample_kernel, sample_partials_reduce_kernel
from tripath.ops import _configs
from tripath.ops._checks import FLOAT_DTYPES, check_tensor
from tripath.platform import current_platform
from tripath.triton_internals import launch, use_triton

M32 = 0xFFFF_FFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57   # Philox-4x32 multipliers and key increments (Salmon et al. 2011)
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
ROW_CHUNK = 16   # rows of noise the reference makes at once (int64 temporaries of [16, V])


@dataclass
class SampleDraw:
    """One token per row: ``tokens [M]`` int64, their ``keys [M]`` (``z + t · G``; ``z`` for greedy rows) and
    logits ``chosen [M]``, and ``lse [M]`` = ``log Σ_v exp(z[m, v])``; float32."""

    tokens: torch.Tensor
    keys: torch.Tensor
    chosen: torch.Tensor
    lse: torch.Tensor

    @property
    def logprobs(self) -> torch.Tensor:
        """``log_softmax(z)`` at each row's token, ``[M]`` float32."""
        return self.chosen - self.lse

    def packed(self) -> torch.Tensor:
        """``[M, 4]`` float32 (keys, logits, LSE, the token's int32 bits): what a rank contributes to
        :func:`merge_packed`."""
        bits = self.tokens.to(torch.int32).view(torch.float32)
        return torch.stack([self.keys, self.chosen, self.lse, bits], dim=1)


def merge_draws(draws: Sequence[SampleDraw]) -> SampleDraw:
    """The draw over the vocabulary split into ``draws`` (in vocabulary order): per row the largest key,
    the first part's among equal keys (its ids are the lower), and the parts' LSEs combined."""
    return merge_packed(torch.stack([d.packed() for d in draws]))


def merge_packed(packed: torch.Tensor) -> SampleDraw:
    """:func:`merge_draws` of the parts' :meth:`SampleDraw.packed` stacked as ``[W, M, 4]``."""
    keys, chosen, lse = packed[..., 0], packed[..., 1], packed[..., 2]
    tokens = packed[..., 3].contiguous().view(torch.int32).to(torch.int64)
    top = keys.amax(dim=0, keepdim=True)
    part = (keys == top).to(torch.int8).argmax(dim=0, keepdim=True)   # the first part holding the largest key
    return SampleDraw(tokens.gather(0, part)[0], top[0], chosen.gather(0, part)[0], torch.logsumexp(lse, dim=0))


# ---- the reference ----------------------------------------------------------------------------------------
def philox_ref(seeds: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, rounds: int = PHILOX_ROUNDS) -> torch.Tensor:
    """The first word of Philox-4x32 with key ``seeds`` (int64, its low and high words) and counter ``(c0, c1,
    0, 0)`` (uint32 values in int64 tensors, broadcast together), as ``tl.philox`` computes it; int64 values in
    ``[0, 2³²)``. The 32×32-bit products are exact in int64's bits (two's complement wraps only the sign).
    The first round is taken with ``c2 = c3 = 0`` folded in; the others work in place."""
    k0, k1 = seeds & M32, (seeds >> 32) & M32
    prod_a = (c0 & M32) * _ROUND_A
    shape = torch.broadcast_shapes(seeds.shape, c0.shape, c1.shape)
    x0 = ((c1 & M32) ^ k0).expand(shape).clone()
    x1 = torch.zeros(shape, dtype=torch.int64, device=c0.device)
    x2 = (((prod_a >> 32) & M32) ^ k1).expand(shape).clone()
    x3 = (prod_a & M32).expand(shape).clone()
    for _ in range(rounds - 1):
        k0, k1 = (k0 + _KEY_A) & M32, (k1 + _KEY_B) & M32
        prod_b, prod_a = x2 * _ROUND_B, x0 * _ROUND_A
        x0 = (prod_b >> 32).bitwise_and_(M32).bitwise_xor_(x1).bitwise_xor_(k0)
        x2 = (prod_a >> 32).bitwise_and_(M32).bitwise_xor_(x3).bitwise_xor_(k1)
        x1, x3 = prod_b.bitwise_and_(M32), prod_a.bitwise_and_(M32)
    return x0


def gumbel_noise_ref(seeds: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[M, V]`` float32 standard Gumbel noise of ``tokens [V]`` (global ids) for rows with ``seeds [M]`` at
    ``positions [M]`` (the kernels' ``gumbel_noise``)."""
    x = philox_ref(seeds.to(torch.int64)[:, None], tokens.to(torch.int64)[None, :], positions.to(torch.int64)[:, None])
    w = (x.to(torch.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10).clamp_(max=0.99999994)
    series = w * (1.0 + w * (0.5 + w * 0.3333333432674408))
    return -torch.where(w < 0.015625, series, -torch.log(1.0 - w)).log()


def draw_ref(z: torch.Tensor, temperature: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
             positions: torch.Tensor | None = None, vocab_offset: int = 0) -> SampleDraw:
    """The draw from float32 logits ``z [M, V]`` (ids from ``vocab_offset``): see the module doc."""
    if not z.shape[1]:   # an empty shard of the vocabulary: nothing to draw (a merge passes over it)
        none = torch.full((z.shape[0],), float("-inf"), device=z.device)
        return SampleDraw(torch.full_like(none, vocab_offset, dtype=torch.int64), none, none.clone(), none.clone())
    keys = z
    if temperature is not None:
        tokens = torch.arange(vocab_offset, vocab_offset + z.shape[1], device=z.device)
        keys = torch.cat([z[i:i + ROW_CHUNK] + temperature[i:i + ROW_CHUNK, None].float()
                          * gumbel_noise_ref(seeds[i:i + ROW_CHUNK], positions[i:i + ROW_CHUNK], tokens)
                          for i in range(0, z.shape[0], ROW_CHUNK)]) if z.shape[0] else z
    best = keys.argmax(dim=1, keepdim=True)
    return SampleDraw(best[:, 0] + vocab_offset, keys.gather(1, best)[:, 0], z.gather(1, best)[:, 0],
                      torch.logsumexp(z, dim=1))


def lm_head_sample_ref(hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor | None = None,
                       seeds: torch.Tensor | None = None, positions: torch.Tensor | None = None, *,
                       vocab_valid: int | None = None, vocab_offset: int = 0) -> SampleDraw:
    """PyTorch reference of :func:`lm_head_sample`: the logits written (``F.linear`` in the LM head's
    dtype, as the unfused LM head computes them), then :func:`draw_ref` in float32."""
    rows = weight.shape[0] if vocab_valid is None else vocab_valid
    z = torch.nn.functional.linear(hidden, weight[:rows]).float()
    return draw_ref(z, temperature, seeds, positions, vocab_offset)


# ---- the ops ------------------------------------------------------------------------------------------------
def _check_rows(num_rows: int, device: torch.device, temperature, seeds, positions) -> None:
    if temperature is None:
        return
    check_tensor("temperature", temperature, ndim=1, dtypes=(torch.float32,), device=device, shape=(num_rows,))
    if seeds is None or positions is None:
        raise ValueError("temperature needs seeds and positions (the noise's key and counter), one per row")
    check_tensor("seeds", seeds, ndim=1, dtypes=(torch.int64,), device=device, shape=(num_rows,))
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64,), device=device, shape=(num_rows,))


def lm_head_sample(hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor | None = None,
                   seeds: torch.Tensor | None = None, positions: torch.Tensor | None = None, *,
                   vocab_valid: int | None = None, vocab_offset: int = 0) -> SampleDraw:
    """The tokens of ``hidden``'s rows under the LM head ``weight``, without writing their logits.

    Parameters
    ----------
    hidden : ``[M, K]`` fp16 / bf16 / fp32, last dimension contiguous (M rows: a decode step's, 1–256).
    weight : ``[V_rows, K]``, the same dtype and device, last dimension contiguous: the LM head (a rank's
        shard under tensor parallelism, zero padding rows at its end allowed).
    temperature : None (every row greedy) or ``[M]`` float32, ``0`` for a greedy row, ``> 0`` sampled (not
        checked on the device: a negative one samples from ``softmax(-z / |t|)``).
    seeds, positions : ``[M]`` int64 each, with ``temperature``: the noise's key and counter (positions below
        2³²).
    vocab_valid : the tokens among ``weight``'s rows (default all of them); the rest is padding.
    vocab_offset : the global id of ``weight``'s first row.

    Returns
    -------
    :class:`SampleDraw` with global token ids.
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device,
                 shape=(None, hidden.shape[1]))
    if hidden.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("hidden and weight must be contiguous in their last dimension")
    vocab = weight.shape[0] if vocab_valid is None else int(vocab_valid)
    if not 0 <= vocab <= weight.shape[0]:
        raise ValueError(f"vocab_valid={vocab} must be in [0, {weight.shape[0]}] (the weight's rows)")
    if not 0 <= vocab_offset < 2 ** 31 - vocab:
        raise ValueError(f"vocab_offset={vocab_offset} puts token ids outside int32")
    num_rows = hidden.shape[0]
    _check_rows(num_rows, hidden.device, temperature, seeds, positions)
    if not use_triton(hidden.device) or num_rows == 0 or vocab == 0:
        return lm_head_sample_ref(hidden, weight, temperature, seeds, positions, vocab_valid=vocab,
                                  vocab_offset=vocab_offset)
    cfg = _configs.lm_head_sample_config(current_platform(hidden.device), num_rows, hidden.element_size(),
                                         temperature is not None)
    block_m, block_v, block_k = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_V"), cfg.pop("BLOCK_K")
    num_tiles = -(-vocab // block_v)
    partials, ids = _partials(num_rows, num_tiles, hidden.device)
    launch(lm_head_sample_kernel, (-(-num_rows // block_m), num_tiles), hidden, weight,
           *_row_args(temperature, seeds, positions, partials, ids), partials, ids,
           num_rows, vocab, vocab_offset, hidden.shape[1], num_tiles, hidden.stride(0), weight.stride(0),
           BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_K=block_k, EVEN_K=hidden.shape[1] % block_k == 0,
           SAMPLE=temperature is not None, IEEE_DOT=hidden.dtype == torch.float32, **cfg)
    return _reduce(partials, ids, num_rows, num_tiles)


def logits_sample(logits: torch.Tensor, temperature: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None, *, vocab_offset: int = 0) -> SampleDraw:
    """The draw of :func:`lm_head_sample` from logits already written: ``logits [M, V]`` (any float dtype,
    last dimension contiguous; converted to float32), the other arguments as there."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous in their last dimension")
    num_rows, vocab = logits.shape
    _check_rows(num_rows, logits.device, temperature, seeds, positions)
    if not use_triton(logits.device) or num_rows == 0 or vocab == 0:
        return draw_ref(logits.float(), temperature, seeds, positions, vocab_offset)
    cfg = _configs.logits_sample_config(current_platform(logits.device))
    block_v = cfg.pop("BLOCK_V")
    num_tiles = -(-vocab // block_v)
    partials, ids = _partials(num_rows, num_tiles, logits.device)
    launch(logits_sample_kernel, (num_rows, num_tiles), logits,
           *_row_args(temperature, seeds, positions, partials, ids), partials, ids, num_rows, vocab, vocab_offset,
           num_tiles, logits.stride(0), BLOCK_V=block_v, SAMPLE=temperature is not None, **cfg)
    return _reduce(partials, ids, num_rows, num_tiles)


def _partials(num_rows: int, num_tiles: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(4, num_rows, num_tiles, dtype=torch.float32, device=device),
            torch.empty(num_rows, num_tiles, dtype=torch.int32, device=device))


def _row_args(temperature, seeds, positions, partials, ids) -> tuple:
    """The per-row pointers, or placeholders the greedy variant never reads."""
    if temperature is None:
        return partials, ids, ids
    return temperature, seeds, positions


def _reduce(partials: torch.Tensor, ids: torch.Tensor, num_rows: int, num_tiles: int) -> SampleDraw:
    tokens = torch.empty(num_rows, dtype=torch.int64, device=partials.device)
    stats = torch.empty(3, num_rows, dtype=torch.float32, device=partials.device)
    block_t = min(1024, max(16, 1 << (num_tiles - 1).bit_length()))
    launch(sample_partials_reduce_kernel, (num_rows,), partials, ids, tokens, stats, num_rows, num_tiles,
           BLOCK_T=block_t, num_warps=4)
    return SampleDraw(tokens, stats[0], stats[1], stats[2])
