"""Device-side checks of one step's attention metadata against the caches it will read and write.

A step's metadata (:class:`tripath.attention.metadata.AttentionMetadata`) indexes the paged cache with
values the kernels trust: ``slot_mapping`` (where each new token's K/V goes), ``block_table`` (which blocks a
request reads), ``seq_lens`` and the ``cu_seqlens`` offsets. :func:`validate_metadata` reads them back (host
syncs, so it is off the fast path) and checks, for ``num_blocks`` blocks of ``block_size`` rows:

- ``seq_lens``, ``context_lens`` and ``cu_seqlens_q`` equal the plan's host lists; ``cu_seqlens_q`` starts
  at 0, never decreases and ends at ``num_tokens``; ``seq_len = context_len + query_len``;
- each request's ``seq_len`` fits in its block-table row, and every block id it reads is in
  ``[0, num_blocks)``;
- every slot is negative (padding, not written) or equals ``block_table[r, p // block_size] * block_size +
  p % block_size`` for the position ``p`` of that token in its request ``r``;
- the decode / extend / prefill views and each extend context chunk are consistent with the whole;
- a backend's own fields (a subclass of ``AttentionMetadata``) pass its
  :meth:`~tripath.attention.metadata.AttentionMetadata.validate_own`, which uses the helpers here
  (:func:`expect`, :func:`host_ints`, :func:`check_offsets`).

:class:`tripath.attention.ForwardContext` runs it on construction when ``TRIPATH_VALIDATE=1``. The engine
never needs it — its scheduler and block manager build these indices — and its tests run with it on, so
every engine step is checked.
"""

from __future__ import annotations

import torch

from tripath.attention.metadata import AttentionMetadata, ContextChunk
from tripath.attention.spec import KVCache, MLACache


class MetadataError(ValueError):
    """The step's metadata would make a kernel read or write outside what it owns."""


def cache_geometry(cache) -> tuple[int, int]:
    """``(num_blocks, block_size)`` of an MHA (:class:`KVCache`) or MLA (:class:`MLACache`) layer cache."""
    if isinstance(cache, KVCache):
        k = cache.k_cache
        return k.shape[0], (k.shape[1] if cache.layout == "nhd" else k.shape[3])
    if isinstance(cache, MLACache):
        return cache.kv_cache.shape[0], cache.kv_cache.shape[1]
    raise TypeError(f"caches must hold KVCache or MLACache objects, got {type(cache).__name__}")


def host_ints(t: torch.Tensor) -> list[int]:
    """The tensor's values as a host list of ints (a host sync)."""
    return t.detach().to("cpu", torch.int64).tolist()


def expect(ok: bool, message: str) -> None:
    """Raise :class:`MetadataError` with ``message`` unless ``ok``."""
    if not ok:
        raise MetadataError(message)


def check_offsets(name: str, got: list[int], lens: list[int]) -> None:
    """``metadata.<name>`` (``got``, host ints) must be the offsets ``[0, l0, l0 + l1, ...]`` of ``lens``."""
    want = [0]
    for n in lens:
        want.append(want[-1] + n)
    expect(got == want, f"metadata.{name} is {got}, expected the offsets {want} of the lengths {lens}")


def validate_metadata(meta: AttentionMetadata, num_blocks: int, block_size: int) -> None:
    """Raise :class:`MetadataError` (a ``ValueError``) naming the field when ``meta`` is inconsistent or
    indexes outside a cache of ``num_blocks`` blocks of ``block_size`` rows (see the module doc)."""
    plan = meta.plan
    b = plan.num_requests
    seq_lens, context_lens, cu_q = host_ints(meta.seq_lens), host_ints(meta.context_lens), host_ints(meta.cu_seqlens_q)
    expect(seq_lens == list(plan.seq_lens), f"metadata.seq_lens is {seq_lens}, the plan's are {plan.seq_lens}")
    expect(context_lens == list(plan.context_lens),
            f"metadata.context_lens is {context_lens}, the plan's are {plan.context_lens}")
    check_offsets("cu_seqlens_q", cu_q, list(plan.query_lens))
    expect(meta.num_tokens == cu_q[-1], f"metadata.num_tokens ({meta.num_tokens}) != cu_seqlens_q[-1] ({cu_q[-1]})")
    for r in range(b):
        q_len = cu_q[r + 1] - cu_q[r]
        expect(context_lens[r] >= 0 and seq_lens[r] == context_lens[r] + q_len,
                f"metadata.seq_lens[{r}] ({seq_lens[r]}) must be context_lens ({context_lens[r]}) + the request's "
                f"new tokens ({q_len})")
    table = meta.block_table
    expect(table.dim() == 2 and table.shape[0] == b,
            f"metadata.block_table must have one row per request ({b}), got shape {tuple(table.shape)}")
    width = table.shape[1]
    rows = host_ints(table)
    for r in range(b):
        used = -(-seq_lens[r] // block_size)
        expect(used <= width, f"metadata.seq_lens[{r}] ({seq_lens[r]}) needs {used} blocks; block_table rows "
                               f"hold {width}")
        bad = [x for x in rows[r][:used] if not 0 <= x < num_blocks]
        expect(not bad, f"metadata.block_table row {r} reads block {bad[:1]} outside [0, num_blocks={num_blocks})")
    slots = host_ints(meta.slot_mapping)
    expect(len(slots) == meta.num_tokens,
            f"metadata.slot_mapping has {len(slots)} entries for {meta.num_tokens} tokens")
    for r in range(b):
        for i, t in enumerate(range(cu_q[r], cu_q[r + 1])):
            if slots[t] < 0:
                continue
            pos = context_lens[r] + i
            want = rows[r][pos // block_size] * block_size + pos % block_size
            expect(slots[t] == want, f"metadata.slot_mapping[{t}] is {slots[t]}; request {r}'s position {pos} "
                                      f"lives at slot {want} by its block table")
    _validate_views(meta, seq_lens, context_lens, cu_q, block_size, width)
    meta.validate_own(num_blocks, block_size)


def _validate_views(meta: AttentionMetadata, seq_lens, context_lens, cu_q, block_size: int, width: int) -> None:
    plan = meta.plan
    nd, ne, npf = plan.num_decodes, plan.num_extends, plan.num_prefills
    expect(nd + ne + npf == plan.num_requests, "the plan's decode, extend and prefill counts do not add up")
    for name, view, count in (("decode", meta.decode, nd), ("extend", meta.extend, ne),
                              ("prefill", meta.prefill, npf)):
        expect((view is not None) == (count > 0), f"metadata.{name} is {'set' if view else 'missing'} for "
                                                   f"{count} requests")
    if meta.decode is not None:
        d = meta.decode
        expect(host_ints(d.seq_lens) == seq_lens[:nd], "metadata.decode.seq_lens differs from the decode rows")
        expect(d.block_table.shape[0] == nd, "metadata.decode.block_table must have a row per decode")
        expect(host_ints(d.cu_seqlens_q) == cu_q[:nd + 1], "metadata.decode.cu_seqlens_q differs from the decode rows")
        nv = plan.num_verifies
        expect(all(q == 1 for q in plan.query_lens[:nd - nv]) and all(q > 1 for q in plan.query_lens[nd - nv:nd]),
               "the decode slice must hold its one-token decodes first, then its num_verifies verifies")
        expect((d.verify is not None) == (nv > 0),
               "metadata.decode.verify must be set exactly when the plan has verifies")
        if d.verify is not None:
            v = d.verify
            expect(v.first_row == v.token_start == nd - nv, "metadata.decode.verify starts at the wrong row")
            expect(host_ints(v.seq_lens) == seq_lens[nd - nv:nd], "metadata.decode.verify.seq_lens differs")
            expect(v.block_table.shape[0] == nv, "metadata.decode.verify.block_table must have a row per verify")
            check_offsets("decode.verify.cu_seqlens_q", host_ints(v.cu_seqlens_q), list(plan.query_lens[nd - nv:nd]))
    if meta.extend is not None:
        e = meta.extend
        rows = range(nd, nd + ne)
        expect(host_ints(e.seq_lens) == seq_lens[nd:nd + ne], "metadata.extend.seq_lens differs from the extend rows")
        ctx = context_lens[nd:nd + ne]
        expect(host_ints(e.context_lens) == ctx, "metadata.extend.context_lens differs from the extend rows")
        q_lens = [cu_q[r + 1] - cu_q[r] for r in rows]
        check_offsets("extend.cu_seqlens_q", host_ints(e.cu_seqlens_q), q_lens)
        expect((e.token_start, e.token_end) == (cu_q[nd], cu_q[nd + ne]),
                f"metadata.extend tokens [{e.token_start}, {e.token_end}) are not the extend rows' "
                f"[{cu_q[nd]}, {cu_q[nd + ne]})")
        for c, chunk in enumerate(e.chunks):
            _check_chunk(f"extend.chunks[{c}]", chunk, ctx, ctx, e.workspace_tokens, width * block_size)
        if e.tail is not None:
            _check_chunk("extend.tail", e.tail, ctx, [s for s in seq_lens[nd:nd + ne]], None, width * block_size)
    if meta.prefill is not None:
        p = meta.prefill
        check_offsets("prefill.cu_seqlens_q", host_ints(p.cu_seqlens_q),
                       [cu_q[r + 1] - cu_q[r] for r in range(nd + ne, nd + ne + npf)])
        expect(context_lens[nd + ne:] == [0] * npf, "metadata.prefill rows must have no cached context")


def _check_chunk(name: str, chunk: ContextChunk, context_lens: list[int], ends: list[int],
                 workspace_tokens: int | None, capacity: int) -> None:
    """A gather of positions ``seq_starts[i] .. + n_i`` of each extend: within ``ends[i]`` and the block
    table, offsets consistent with ``num_tokens``, ``q_positions_start = context_len − start``."""
    cu, starts, q_start = host_ints(chunk.cu_seqlens_k), host_ints(chunk.seq_starts), host_ints(chunk.q_positions_start)
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    check_offsets(f"{name}.cu_seqlens_k", cu, lens)
    expect(len(starts) == len(lens) == len(context_lens), f"metadata.{name} must have one entry per extend")
    expect(chunk.num_tokens == cu[-1], f"metadata.{name}.num_tokens ({chunk.num_tokens}) != cu_seqlens_k[-1] "
                                        f"({cu[-1]})")
    expect(chunk.max_len == max(lens, default=0), f"metadata.{name}.max_len ({chunk.max_len}) is not the "
                                                   f"longest piece ({max(lens, default=0)})")
    if workspace_tokens is not None:
        expect(chunk.num_tokens <= workspace_tokens,
                f"metadata.{name} gathers {chunk.num_tokens} rows into a workspace of {workspace_tokens}")
    for i, (s, n) in enumerate(zip(starts, lens)):
        expect(0 <= s and s + n <= min(ends[i], capacity),
                f"metadata.{name} reads positions [{s}, {s + n}) of extend {i}, past its {ends[i]} tokens")
        expect(q_start[i] == context_lens[i] - s,
                f"metadata.{name}.q_positions_start[{i}] is {q_start[i]}, expected {context_lens[i] - s}")
