"""Per-step attention metadata: the plan's host lists turned into device tensors once, shared by every
layer. Sub-metadata per class holds views into the step's tensors (no copies, no host syncs in forward).

Rows (requests) and tokens are in plan order, so each class is a contiguous slice:
``decode`` rows ``[0, D)``, ``extend`` rows ``[D, D + E)``, ``prefill`` rows after; likewise for tokens.

A backend that needs more per-step data returns a subclass of :class:`AttentionMetadata` from its
``build_metadata`` (built once per step there, never in forward) with named fields, and extends
:meth:`AttentionMetadata.copy_` and :meth:`AttentionMetadata.validate_own` to cover them:
``TwoPathMetadata`` (:mod:`tripath.attention.backends.two_path`), ``MLAMetadata``
(:mod:`tripath.attention.backends.mla_common`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from tripath.attention.planner import BatchPlan
from tripath.attention.step_ints import StepInts, add_common_ints, tail_lengths


@dataclass
class VerifyMetadata:
    """The decode slice's verifies (several tokens each; speculative decoding): its rows ``[first_row,
    num_reqs)`` and tokens ``[token_start, num_tokens)`` of the decode slice (one token for each row before
    them), ``block_table`` / ``seq_lens`` their rows, ``cu_seqlens_q [V + 1]`` their token offsets from 0;
    ``tree_mask``: ``[num_tokens - token_start]`` int32, the verifies' draft trees (bit ``j`` of a token's
    entry: it attends to its request's new token ``j``; :func:`tripath.ops.paged_verify`), None for chains
    (causal). The engine sets it after ``build_metadata`` on backends with ``Capabilities.draft_trees``."""

    first_row: int
    token_start: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int
    tree_mask: torch.Tensor | None = None


@dataclass
class DecodeMetadata:
    """Decodes: rows ``[0, num_reqs)``, tokens ``[0, num_tokens)``; ``single_token`` when every decode has
    one query token (paged decode); otherwise (speculative decode) ``cu_seqlens_q`` is used, and ``verify``
    describes the rows of several tokens, which follow the one-token rows."""

    num_reqs: int
    num_tokens: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int
    max_seq_len: int
    single_token: bool
    num_splits: int | None = None
    verify: VerifyMetadata | None = None


@dataclass
class ContextChunk:
    """One chunk of the extends' cached context: ``cu_seqlens_k [E + 1]`` offsets into the workspace,
    ``seq_starts [E]`` first cached position gathered, ``q_positions_start [E]`` = context_len − start
    (query 0's position in chunk coordinates), ``max_len`` the longest piece, ``num_tokens`` the rows
    gathered (``cu_seqlens_k[-1]``, on the host): backends hand attention the workspace's first
    ``num_tokens`` rows only, never rows a previous step left behind."""

    cu_seqlens_k: torch.Tensor
    seq_starts: torch.Tensor
    q_positions_start: torch.Tensor
    max_len: int
    num_tokens: int


@dataclass
class ExtendMetadata:
    """Extends: ``token_start..token_end``; new tokens' ``cu_seqlens_q [E + 1]`` (local), the context
    chunks, and the gather workspace size in tokens. ``tail`` is the last chunk joined with the extends'
    new tokens (positions ``[start, seq_len)`` of each extend, ``tail_tokens`` in all), for backends that
    read the new keys back from the cache and attend to them in the same causal launch as that chunk."""

    num_reqs: int
    token_start: int
    token_end: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int
    max_context_len: int
    chunks: list[ContextChunk] = field(default_factory=list)
    workspace_tokens: int = 0
    tail: ContextChunk | None = None
    tail_tokens: int = 0


@dataclass
class PrefillMetadata:
    """Prefills: ``token_start..token_end``; ``cu_seqlens_q [P + 1]`` (local)."""

    num_reqs: int
    token_start: int
    token_end: int
    cu_seqlens_q: torch.Tensor
    max_query_len: int


@dataclass
class AttentionMetadata:
    """Everything a backend's forward needs for one step (all layers): the plan, the step's device tensors
    (rows and tokens in plan order; ``B`` requests, ``T`` new tokens) and the per-class views. A backend
    with per-step data of its own returns a subclass with named fields (see the module doc)."""

    plan: BatchPlan
    num_tokens: int
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    context_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    decode: DecodeMetadata | None = None
    extend: ExtendMetadata | None = None
    prefill: PrefillMetadata | None = None
    version: int = 0   # bumped by each in-place change of the step tensors (copy_, copy_padded_, advance_decodes_)

    @classmethod
    def from_common(cls, common: "AttentionMetadata", **own):
        """A subclass's metadata: the fields of ``common`` (what :func:`build_metadata` returned, shared, not
        copied) plus the subclass's own fields ``own``."""
        shared = {f.name: getattr(common, f.name) for f in fields(AttentionMetadata)}
        return cls(**shared, **own)

    def copy_(self, other: "AttentionMetadata") -> "AttentionMetadata":
        """Copy ``other``'s step tensors into this one's, in place (same shapes; CUDA-graph replay).

        Only tensors are copied: host ints (``max_seq_len``, the decode split count, …) keep the values
        of the captured step, so a captured decode launch depends on tensor contents alone. Capture with a
        fixed ``decode_num_splits`` and a block table as wide as the longest sequence you will replay.
        ``other``'s block table may be narrower (as wide as the step's longest row): only those columns
        are copied; the columns past them keep older block ids, which no kernel reads (a row's blocks are
        read only up to its ``seq_lens``). Subclasses copy their own device tensors too (after this)."""
        if type(other) is not type(self):
            raise TypeError(f"metadata of type {type(other).__name__} cannot be copied into the captured "
                            f"{type(self).__name__} (build both with the same backend)")
        for name in ("slot_mapping", "block_table", "seq_lens", "context_lens", "cu_seqlens_q"):
            copy_step_tensor(name, getattr(self, name), getattr(other, name), table=name == "block_table")
        mine, theirs = (m.decode.verify if m.decode is not None else None for m in (self, other))
        if mine is not None and theirs is not None:   # its table and lengths are views of the above
            copy_step_tensor("decode.verify.cu_seqlens_q", mine.cu_seqlens_q, theirs.cu_seqlens_q)
            copy_step_tensor("decode.verify.tree_mask", mine.tree_mask, theirs.tree_mask)
        self.version += 1
        return self

    def copy_padded_(self, other: "AttentionMetadata") -> "AttentionMetadata":
        """Copy a step of ``b`` requests and ``t`` new tokens (``other``) into this captured bucket of
        ``B >= b`` requests and ``T >= t`` tokens, in place (whole-step CUDA-graph replay): the step's rows
        and tokens first; requests ``b .. B - 1`` become padding of no new tokens and no keys
        (``seq_lens`` / ``context_lens`` 0, ``cu_seqlens_q`` at ``t``), and tokens ``t .. T - 1`` write
        nothing (slot −1). Only the common tensors are copied, so this serves backends whose forward reads
        only them (:attr:`~tripath.attention.backends.base.GraphSupport.ALL`); the per-class views keep the
        captured step's partition. The block table may be narrower than the captured one (as in
        :meth:`copy_`)."""
        if type(other) is not type(self):
            raise TypeError(f"metadata of type {type(other).__name__} cannot be copied into the captured "
                            f"{type(self).__name__} (build both with the same backend)")
        b, t = other.plan.num_requests, other.num_tokens
        if b > self.plan.num_requests or t > self.num_tokens:
            raise ValueError(f"a step of {b} requests and {t} tokens does not fit the captured bucket of "
                             f"{self.plan.num_requests} requests and {self.num_tokens} tokens")
        copy_step_tensor("slot_mapping", self.slot_mapping[:t], other.slot_mapping)
        self.slot_mapping[t:].fill_(-1)
        copy_step_tensor("block_table", self.block_table[:b], other.block_table, table=True)
        for name in ("seq_lens", "context_lens"):
            mine = getattr(self, name)
            copy_step_tensor(name, mine[:b], getattr(other, name))
            mine[b:].zero_()
        copy_step_tensor("cu_seqlens_q", self.cu_seqlens_q[:b + 1], other.cu_seqlens_q)
        self.cu_seqlens_q[b + 1:].fill_(t)
        self.version += 1
        return self

    def advance_decodes_(self, positions: torch.Tensor, block_size: int) -> None:
        """Move the first ``n = positions.shape[0]`` rows of a decode-only step on by one token, in place
        and on the device (multi-step decoding: the next step's metadata without the host).

        ``positions [n]`` int64, the rows' token positions, is advanced too. Then for each row ``r < n``:
        ``seq_lens[r]`` and ``context_lens[r]`` grow by one and ``slot_mapping[r]`` becomes the slot of
        the new position, ``block_table[r, p // block_size] * block_size + p % block_size`` (the block table
        must already hold that block). Rows past ``n`` (padding) keep their values. Host ints
        (``max_seq_len``, …) keep the first step's values: a decode launch reads the tensors only. One
        launch on a GPU (:func:`tripath.ops.kv_cache.advance_decodes`), the same math in PyTorch elsewhere."""
        n = positions.shape[0]
        if self.plan.num_decodes != self.plan.num_requests or self.num_tokens != self.plan.num_requests:
            raise ValueError("advance_decodes_ needs a step of single-token decodes only")
        if n > self.num_tokens:
            raise ValueError(f"advance_decodes_: {n} positions for a step of {self.num_tokens} rows")
        from tripath.ops.kv_cache import advance_decodes, advance_decodes_ref  # kernels load with a backend

        advance = advance_decodes if positions.is_cuda else advance_decodes_ref
        advance(positions, self.seq_lens, self.context_lens, self.block_table, self.slot_mapping, block_size)
        self.version += 1

    def validate_own(self, num_blocks: int, block_size: int) -> None:
        """Check a subclass's own fields against the plan and the common ones (see
        :func:`tripath.attention.validate.validate_metadata`, which calls it last); nothing here."""


def both_set(name: str, mine, theirs) -> bool:
    """Whether the captured field ``mine`` and the step's ``theirs`` are both set (False: both None); a
    field set in one and None in the other cannot be copied (:class:`ValueError`)."""
    if (mine is None) != (theirs is None):
        raise ValueError(f"metadata.{name} is {'set' if theirs is not None else 'None'} in the step but "
                         f"{'set' if mine is not None else 'None'} in the captured metadata")
    return mine is not None


def copy_step_tensor(name: str, mine: torch.Tensor | None, theirs: torch.Tensor | None, *,
                     table: bool = False) -> None:
    """Copy a step's tensor ``theirs`` into the captured ``mine`` in place (both None: nothing to copy).
    ``table``: a block table ``[rows, width]``, whose step version may be narrower than the captured one:
    only its columns are copied (see :meth:`AttentionMetadata.copy_`)."""
    if not both_set(name, mine, theirs):
        return
    if table and mine.dim() == theirs.dim() == 2 and theirs.shape[0] == mine.shape[0] \
            and theirs.shape[1] <= mine.shape[1]:
        mine = mine[:, :theirs.shape[1]]
    if mine.shape != theirs.shape:
        raise ValueError(f"metadata.{name}: shape {tuple(theirs.shape)} does not match the captured "
                         f"{tuple(mine.shape)}")
    mine.copy_(theirs, non_blocking=True)


def build_metadata(plan: BatchPlan, block_table: torch.Tensor, slot_mapping: torch.Tensor, *,
                   decode_num_splits: int | None = None, ints: StepInts | None = None) -> AttentionMetadata:
    """Turn a plan and the step's block table / slot mapping (rows and tokens in plan order) into metadata.
    ``ints``: the step's integers already on the device (:mod:`tripath.attention.step_ints`, holding at least
    :func:`~tripath.attention.step_ints.add_common_ints`'s lists); None: gathered and uploaded here."""
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be a [num_requests, max_blocks] int32 tensor, got "
                        f"{block_table.dtype} of shape {tuple(block_table.shape)}")
    if block_table.shape[0] != plan.num_requests:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {plan.num_requests} requests")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != plan.num_tokens:
        raise ValueError(f"slot_mapping must be [{plan.num_tokens}] (one slot per new token), got "
                         f"{tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    device = block_table.device
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but block_table on {device}")
    if ints is None:
        ints = add_common_ints(plan, StepInts()).upload(device)

    seq_lens_host = plan.seq_lens
    nd, nv = plan.num_decodes, plan.num_verifies
    packed = ints.view("packed")
    b = plan.num_requests
    seq_lens, context_lens, cu_seqlens_q = packed[:b], packed[b:2 * b], packed[2 * b:3 * b + 1]
    meta = AttentionMetadata(
        plan=plan, num_tokens=plan.num_tokens, slot_mapping=slot_mapping, block_table=block_table,
        seq_lens=seq_lens, context_lens=context_lens, cu_seqlens_q=cu_seqlens_q,
        max_query_len=max(plan.query_lens, default=0), max_seq_len=max(seq_lens_host, default=0))

    ne, npf = plan.num_extends, plan.num_prefills
    if nd:
        d0, d1 = plan.decode_tokens
        verify = None
        if nv:
            first = nd - nv
            verify = VerifyMetadata(first_row=first, token_start=first, block_table=block_table[first:nd],
                                    seq_lens=seq_lens[first:nd], cu_seqlens_q=packed[3 * b + 1:],
                                    max_query_len=max(plan.query_lens[first:nd]))
        meta.decode = DecodeMetadata(
            num_reqs=nd, num_tokens=d1 - d0, block_table=block_table[:nd], seq_lens=seq_lens[:nd],
            cu_seqlens_q=cu_seqlens_q[:nd + 1], max_query_len=max(plan.query_lens[:nd]),
            max_seq_len=max(seq_lens_host[:nd]), single_token=max(plan.query_lens[:nd]) == 1,
            num_splits=decode_num_splits, verify=verify)
    if ne:
        e0, e1 = plan.extend_tokens
        ext_q = plan.query_lens[nd:nd + ne]
        ext_ctx = plan.context_lens[nd:nd + ne]
        chunks = plan.extend_chunks

        def chunk(name: str, max_len: int, num_tokens: int) -> ContextChunk:
            view = ints.view(name)
            return ContextChunk(cu_seqlens_k=view[:ne + 1], seq_starts=view[ne + 1:2 * ne + 1],
                                q_positions_start=view[2 * ne + 1:], max_len=max_len, num_tokens=num_tokens)

        chunk_list = [chunk(f"chunk{c}", max(chunks.lens[c]), sum(chunks.lens[c])) for c in range(chunks.num_chunks)]
        _, tail_lens = tail_lengths(plan)
        tail = chunk("tail", max(tail_lens), sum(tail_lens)) if tail_lens else None
        meta.extend = ExtendMetadata(
            num_reqs=ne, token_start=e0, token_end=e1, block_table=block_table[nd:nd + ne],
            seq_lens=seq_lens[nd:nd + ne], context_lens=context_lens[nd:nd + ne], cu_seqlens_q=ints.view("extend_cu_q"),
            max_query_len=max(ext_q), max_context_len=max(ext_ctx), chunks=chunk_list,
            workspace_tokens=chunks.workspace_tokens, tail=tail, tail_tokens=sum(tail_lens))
    if npf:
        p0, p1 = plan.prefill_tokens
        meta.prefill = PrefillMetadata(num_reqs=npf, token_start=p0, token_end=p1,
                                       cu_seqlens_q=ints.view("prefill_cu_q"),
                                       max_query_len=max(plan.query_lens[nd + ne:]))
    return meta
