"""The work list of the one-launch mixed attention (:mod:`tripath.kernels.mixed_attention`), built on the device.

One program reads the step's ``cu_seqlens_q [B + 1]`` and ``seq_lens [B]`` and writes the items every
layer's attention launch of the step then walks. Request ``b``'s new tokens sit at positions
``seq_len - query_len + t`` and attend causally to its paged keys.

**Tiles.** A request of one new token is a *decode tile*: that token × the ``G`` query heads of one KV
head. A longer request is cut into *prompt tiles* of ``BLOCK_Q`` new tokens × ``G`` heads. Tiles are
numbered as :mod:`tripath.kernels.unified_attention` numbers its query blocks (request ``i``'s first is
``cu_seqlens_q[i] // BLOCK_Q + i``), so ``num_tokens // BLOCK_Q + B`` candidates cover every tile of a step of
at most ``num_tokens`` new tokens, and a candidate finds its request by binary search. A tile reads the keys
``[lo, hi)``: ``hi`` one past its last token's position, ``lo`` 0 or, with a window, the window's start for
its first token rounded down to the kind's key tile (``BLOCK_N`` / ``DECODE_BLOCK_N``).

**Items.** Each tile's key range is cut into pieces of at most ``S`` keys (``S`` a multiple of both key tiles):
``[lo + j·S, min(lo + (j + 1)·S, hi))``, one item each, laid out as ``ITEM_FIELDS`` int32::

    (request, kind (1 decode / 0 prompt), first new token of the tile, kv_lo, kv_hi, slot0, piece, pieces)

A tile of one piece writes the output itself (``slot0 = -1``). The pieces of a split tile write fp32 partials
into slots ``slot0 + piece`` and are merged by the last of them to finish; its merge counter is
``counters[slot0, kv_head]`` (:mod:`tripath.kernels.mixed_attention`). ``counts`` receives
``(number of items, S, tiles, slots used)``.

**Cost model (S).** The step's work is ``W = Σ_tiles (hi - lo)`` (key tokens a tile reads for one KV head; a
tile costs about its key count whichever its kind, as both are bound by loading K/V tiles at these row
counts). The attention launch has ``P`` persistent programs and runs ``items × Hkv`` works; it is balanced
when there are about ``target_items = ⌈WAVES · P / Hkv⌉`` items of similar size, so
``S = max(min_split, ⌈W / target_items⌉)`` (or the caller's ``kv_split`` when positive), then
``S >= ⌈W / split_budget⌉`` and rounded up to the key tiles. That last bound keeps the list in its buffer
whatever the mix: ``items = Σ ⌈len/S⌉ <= W/S + tiles <= split_budget + tiles``, and the pieces of split tiles
(``len > S``, so ``⌈len/S⌉ < 2·len/S``) need at most ``2 · split_budget`` slots. The bounds are host numbers
of the bucket (``num_tokens // BLOCK_Q + B + split_budget`` items, ``2 · split_budget`` slots), so the buffers
and the attention launch's grid are fixed and the step can be captured in a CUDA graph whatever its mix.
"""

import triton
import triton.language as tl

from tripath.triton_internals.specialize import STEP_INVARIANT

ITEM_FIELDS = tl.constexpr(8)  # instantiated: compiled kernels may only read constexpr globals


@triton.jit
def mixed_tiles(c, cu_seqlens_q_ptr, seq_lens_ptr, num_seqs, num_candidates, window_left,
                BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DECODE_BLOCK_N: tl.constexpr,
                BINARY_STEPS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Tile candidates ``c [C]`` → ``(valid, seq, decode, tok0, lo, hi)``, each ``[C]`` int32 (see the module
    doc; ``valid`` false for candidates past a request's tiles or the step's)."""
    in_range = (c < num_candidates) & (num_seqs > 0)
    lo_s = tl.zeros(c.shape, tl.int32)
    hi_s = lo_s + num_seqs
    for _ in range(BINARY_STEPS):
        mid = (lo_s + hi_s) // 2
        first = tl.load(cu_seqlens_q_ptr + mid, mask=in_range & (mid < num_seqs), other=0) // BLOCK_Q + mid
        go_right = first <= c
        lo_s = tl.where(go_right, mid, lo_s)
        hi_s = tl.where(go_right, hi_s, mid)
    seq = lo_s
    q_begin = tl.load(cu_seqlens_q_ptr + seq, mask=in_range, other=0)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1, mask=in_range, other=0) - q_begin
    local = c - (q_begin // BLOCK_Q + seq)
    decode = query_len == 1
    valid = in_range & (local >= 0) & (local * BLOCK_Q < query_len)
    seq_len = tl.load(seq_lens_ptr + seq, mask=valid, other=0)
    tok0 = tl.where(decode, 0, local * BLOCK_Q)
    hi = seq_len - query_len + tl.minimum(tok0 + BLOCK_Q, query_len)
    lo = tl.zeros(c.shape, tl.int32)
    if HAS_WINDOW:
        p_min = seq_len - query_len + tok0
        block_n = tl.where(decode, DECODE_BLOCK_N, BLOCK_N)
        lo = (tl.maximum(p_min - window_left, 0) // block_n) * block_n
    hi = tl.maximum(hi, lo)  # a length shorter than its new tokens (invalid metadata) reads nothing
    return valid, seq, decode, tok0, lo, hi


@triton.jit(**STEP_INVARIANT)
def plan_mixed_work_kernel(
    cu_seqlens_q_ptr, seq_lens_ptr, items_ptr, counts_ptr,
    num_seqs, num_tokens, kv_split, min_split, target_items, split_budget, window_left,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DECODE_BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    BINARY_STEPS: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """One program: the work list of a step of ``num_seqs`` requests and at most ``num_tokens`` new tokens, in
    ``BLOCK_C`` candidates at a time; pass 1 sums the work and picks ``S``, pass 2 writes the items."""
    KEY_TILE: tl.constexpr = BLOCK_N if BLOCK_N > DECODE_BLOCK_N else DECODE_BLOCK_N
    num_candidates = num_tokens // BLOCK_Q + num_seqs
    lanes = tl.arange(0, BLOCK_C)
    work = tl.full([], 0, tl.int64)
    tiles = 0
    for start in range(0, num_candidates, BLOCK_C):
        valid, seq, decode, tok0, lo, hi = mixed_tiles(start + lanes, cu_seqlens_q_ptr, seq_lens_ptr, num_seqs,
                                                       num_candidates, window_left, BLOCK_Q, BLOCK_N,
                                                       DECODE_BLOCK_N, BINARY_STEPS, HAS_WINDOW)
        work += tl.sum(tl.where(valid, hi - lo, 0).to(tl.int64), 0)
        tiles += tl.sum(valid.to(tl.int32), 0)

    split = tl.maximum(min_split, (work + target_items - 1) // target_items)
    if kv_split > 0:
        split = tl.full([], 0, tl.int64) + kv_split
    split = tl.maximum(split, (work + split_budget - 1) // split_budget)
    split = (tl.maximum(split, 1) + KEY_TILE - 1) // KEY_TILE * KEY_TILE
    split = split.to(tl.int32)

    num_items = 0
    num_slots = 0
    for start in range(0, num_candidates, BLOCK_C):
        valid, seq, decode, tok0, lo, hi = mixed_tiles(start + lanes, cu_seqlens_q_ptr, seq_lens_ptr, num_seqs,
                                                       num_candidates, window_left, BLOCK_Q, BLOCK_N,
                                                       DECODE_BLOCK_N, BINARY_STEPS, HAS_WINDOW)
        pieces = tl.where(valid, tl.maximum((hi - lo + split - 1) // split, 1), 0)
        slotted = tl.where(pieces > 1, pieces, 0)
        first_item = num_items + tl.cumsum(pieces, 0) - pieces
        slot0 = tl.where(pieces > 1, num_slots + tl.cumsum(slotted, 0) - slotted, -1)
        kind = decode.to(tl.int32)
        for j in range(0, tl.max(pieces, 0)):
            keep = j < pieces
            row = items_ptr + (first_item + j).to(tl.int64) * ITEM_FIELDS
            piece_lo = lo + j * split
            tl.store(row + 0, seq, mask=keep)
            tl.store(row + 1, kind, mask=keep)
            tl.store(row + 2, tok0, mask=keep)
            tl.store(row + 3, piece_lo, mask=keep)
            tl.store(row + 4, tl.minimum(piece_lo + split, hi), mask=keep)
            tl.store(row + 5, slot0, mask=keep)
            tl.store(row + 6, tl.zeros_like(seq) + j, mask=keep)
            tl.store(row + 7, pieces, mask=keep)
        num_items += tl.sum(pieces, 0)
        num_slots += tl.sum(slotted, 0)
    tl.store(counts_ptr + 0, num_items)
    tl.store(counts_ptr + 1, split)
    tl.store(counts_ptr + 2, tiles)
    tl.store(counts_ptr + 3, num_slots)
