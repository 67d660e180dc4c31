"""Shared test helpers: random paged caches with random block tables, poisoned outputs, tolerances."""

from __future__ import annotations

import torch

from tripath.ops.kv_cache import allocate_kv_cache, write_kv_cache_ref

TOL = {torch.float16: dict(atol=1.5e-2, rtol=1e-2), torch.bfloat16: dict(atol=1.5e-2, rtol=1e-2),
       torch.float32: dict(atol=1e-4, rtol=1e-4)}
FP8_TOL = dict(atol=6e-2, rtol=6e-2)
TF32_TOL = dict(atol=3e-3, rtol=3e-3)   # fp32 on a GPU: tl.dot takes fp32 operands as TF32 (10-bit mantissa)


def kernel_tolerance(dtype, device) -> dict:
    """The tolerance of a Triton kernel's output in ``dtype`` on ``device``: :data:`TOL`, or :data:`TF32_TOL`
    for fp32 on a GPU."""
    return TF32_TOL if dtype == torch.float32 and torch.device(device).type != "cpu" else TOL[dtype]


def poison(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN, so any element a kernel forgets to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def cu_seqlens(lengths, device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out.to(device)


def random_block_table(seq_lens, block_size, device, extra_blocks=3):
    """Block table ``[B, max_blocks]`` int32 using a random permutation of blocks 1..N (0 reserved);
    unused entries are 0. Returns ``(block_table, num_blocks)``."""
    need = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(need + [1])
    num_blocks = sum(need) + extra_blocks + 1
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    return table.to(device), num_blocks


def slots_for(block_table, positions_per_seq, block_size) -> torch.Tensor:
    """int64 slot of each (request, position) pair, request by request."""
    slots = []
    for i, pos in enumerate(positions_per_seq):
        pos = torch.as_tensor(pos, dtype=torch.int64, device=block_table.device)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64, device=block_table.device)


def filled_cache(seq_lens, num_kv_heads, head_size, *, block_size=16, dtype=torch.float16, cache_dtype=None,
                 layout="nhd", device="cpu", head_size_v=None, k_scale=None, v_scale=None):
    """A paged cache holding random K/V for every position of every request, NaN everywhere else.

    Returns ``(k_cache, v_cache, block_table, keys, values)`` with ``keys[i] [seq_len_i, Hkv, D]`` the
    values written (before any fp8 quantisation).
    """
    head_size_v = head_size_v or head_size
    cache_dtype = cache_dtype or dtype
    block_table, num_blocks = random_block_table(seq_lens, block_size, device)
    k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype=cache_dtype,
                                         layout=layout, device=device)
    k_cache.fill_(float("nan"))  # poison: slots no request wrote must never reach an output
    v_cache.fill_(float("nan"))
    keys = [torch.randn(s, num_kv_heads, head_size, dtype=dtype, device=device) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_size_v, dtype=dtype, device=device) for s in seq_lens]
    slots = slots_for(block_table, [torch.arange(s) for s in seq_lens], block_size)
    if sum(seq_lens):
        # The reference writer: fast under the interpreter (the kernel is tested on its own).
        write_kv_cache_ref(torch.cat(keys), torch.cat(values), k_cache, v_cache, slots, layout=layout,
                           k_scale=k_scale, v_scale=v_scale)
    return k_cache, v_cache, block_table, keys, values


def naive_attention(q, k, v, *, q_start, causal=True, sm_scale=None, window_left=-1, softcap=0.0,
                    alibi_slopes=None, sinks=None):
    """Independent float64 attention of one request, row by row: ``q [Sq,Hq,D]``, ``k [Sk,Hkv,D]``,
    ``v [Sk,Hkv,Dv]``; query ``i`` at position ``q_start + i``, key ``j`` at ``j``.
    Returns ``(out [Sq,Hq,Dv], lse [Sq,Hq])`` float64 (0 and -inf for rows that see nothing)."""
    import math
    sq, hq, d = q.shape
    sk, hkv, dv = v.shape
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(sq, hq, dv, dtype=torch.float64)
    lse = torch.full((sq, hq), float("-inf"), dtype=torch.float64)
    qd, kd, vd = q.double().cpu(), k.double().cpu(), v.double().cpu()
    for h in range(hq):
        kv = h // (hq // hkv)
        for i in range(sq):
            p = q_start + i
            keys = [j for j in range(sk) if (not causal or j <= p) and (window_left < 0 or p - j <= window_left)]
            logits = []
            for j in keys:
                s = scale * float(qd[i, h] @ kd[j, kv])
                if softcap > 0:
                    s = softcap * math.tanh(s / softcap)
                if alibi_slopes is not None:
                    s += float(alibi_slopes[h]) * (j - p)
                logits.append(s)
            extra = [float(sinks[h])] if sinks is not None else []
            if not logits and not extra:
                continue
            m = max(logits + extra)
            weights = [math.exp(s - m) for s in logits]
            denom = sum(weights) + sum(math.exp(s - m) for s in extra)
            if keys:
                out[i, h] = sum(w * vd[j, kv] for w, j in zip(weights, keys)) / denom
            lse[i, h] = m + math.log(denom)
    return out, lse
