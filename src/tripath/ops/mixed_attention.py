"""One-launch mixed attention: a step's decodes, extends and prefills in one persistent launch a layer, its work
list planned on the device once a step (:mod:`tripath.kernels.mixed_plan`, :mod:`tripath.kernels.mixed_attention`).

Use::

    ws = mixed_attention_workspace(Hq, Hkv, D, max_num_tokens=T_max, max_num_seqs=B_max, device=dev)
    plan_mixed_attention(ws, cu_seqlens_q, seq_lens)                       # once a step: one launch
    for layer ...:
        mixed_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, workspace=ws, planned=True)

The workspace (work list, merge counters, split partials) is allocated once for a bucket (at most ``T_max`` new
tokens and ``B_max`` requests) and reused: with a workspace neither call allocates or reads a device value on
the host, and the launches' grids depend on the bucket alone, so both can be captured in a CUDA graph and
replayed for any mix that fits it. Without ``planned`` the call plans first (two launches); without a
workspace it also allocates one for its own step. A workspace serves one launch at a time (its merge counters
are shared): layers on one stream, not concurrent ones. Its memory: ``2 · split_budget`` partial slots of
``Hkv × BLOCK_M × Dv`` fp32 (about 69 MB at 32/8/128 on a 132-SM GPU), and the work list.

Without Triton (a CPU without the interpreter) the op runs :func:`tripath.ops.reference.unified_attention_ref`
(the same semantics) and planning does nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tripath.kernels.mixed_attention import mixed_attention_kernel
from tripath.kernels.mixed_plan import ITEM_FIELDS, plan_mixed_work_kernel
from tripath.ops import _configs, reference
from tripath.ops._attention_checks import (check_attention_options, check_cu_seqlens, check_new_tokens_out,
                                           check_paged, lse_out)
from tripath.ops._checks import check_head_size, check_tensor, next_pow2
from tripath.ops.kv_cache import cache_strides, shuffle_width
from tripath.platform import FP8_DTYPES, current_platform
from tripath.triton_internals import launch, use_triton

PLAN_LANES = 1024  # tile candidates the planner takes at a time: a bucket of up to ~8K tokens in one pass, whose
# dependent loads (the binary search) set its time; the interpreter takes 16, so the tests cross chunks


@dataclass(eq=False)
class MixedAttentionWorkspace:
    """The device buffers of :func:`mixed_attention` for one bucket, and the launch shape they were sized for.

    ``items [max_items, 8]`` int32: the work list (:mod:`tripath.kernels.mixed_plan`); ``counts [4]`` int32:
    ``(items, kv_split, tiles, slots)`` of the last plan; ``part_out [slots, Hkv, BLOCK_M, BLOCK_DV]`` and
    ``part_lse [slots, Hkv, BLOCK_M]`` fp32: split partials; ``counters [slots, Hkv]`` int32: merge counters,
    zero between launches. ``programs``: the persistent grid; ``target_items``, ``split_budget``,
    ``min_split``: the cost model's numbers (:func:`tripath.ops._configs.mixed_schedule`); ``config``: the
    attention launch's tiles; ``window_left``: the window the last plan was made for (None: no plan yet)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    max_num_tokens: int
    max_num_seqs: int
    device: torch.device
    config: dict
    programs: int
    target_items: int
    split_budget: int
    min_split: int
    items: torch.Tensor
    counts: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor
    counters: torch.Tensor
    window_left: int | None = None

    @property
    def block_q(self) -> int:
        return self.config["BLOCK_Q"]

    @property
    def max_items(self) -> int:
        return self.items.shape[0]

    def plan_counts(self) -> dict:
        """The last plan's ``items``, ``kv_split``, ``tiles`` and ``slots`` (reads the device: tests, debugging)."""
        return dict(zip(("items", "kv_split", "tiles", "slots"), self.counts.tolist()))

    def reset(self) -> None:
        """Zero the merge counters (after a launch that did not finish, e.g. an error mid-step)."""
        self.counters.zero_()


def mixed_attention_workspace(num_heads: int, num_kv_heads: int, head_size: int, *, max_num_tokens: int,
                              max_num_seqs: int, device, head_size_v: int | None = None,
                              split_budget: int | None = None, programs: int | None = None,
                              share: MixedAttentionWorkspace | None = None,
                              kv_fp8: bool = False) -> MixedAttentionWorkspace:
    """Allocate the buffers of :func:`mixed_attention` for steps of at most ``max_num_tokens`` new tokens and
    ``max_num_seqs`` requests. ``kv_fp8``: the KV cache it serves is fp8 (the launch's tiles are chosen for it,
    :func:`tripath.ops._configs.mixed_config`; any cache gives the same results). ``split_budget`` (default:
    the platform's, twice the cost model's target) bounds the list's pieces beyond one a tile, and sizes the
    partials (``2 · split_budget`` slots); ``programs`` replaces the persistent grid's size (default:
    :func:`tripath.ops._configs.mixed_schedule`).

    ``share``: a workspace of the same heads, head sizes, device and split budget whose partials, merge
    counters and counts the new one uses too (they do not depend on the bucket): a larger bucket then costs
    only its work list, and ``share``'s own work list stays valid for whatever holds it (a captured CUDA
    graph). The two serve one launch at a time between them."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:   # "cuda": the current device, as tensors name it
        device = torch.device("cuda", torch.cuda.current_device())
    head_size_v = head_size if head_size_v is None else head_size_v
    check_head_size("head_size", head_size)
    check_head_size("head_size_v", head_size_v)
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    for name, value in (("max_num_tokens", max_num_tokens), ("max_num_seqs", max_num_seqs)):
        if int(value) < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if split_budget is not None and int(split_budget) < 1:
        raise ValueError(f"split_budget must be at least 1, got {split_budget}")
    if programs is not None and int(programs) < 1:
        raise ValueError(f"programs must be at least 1, got {programs}")
    platform = current_platform(device)
    block_g = next_pow2(num_heads // num_kv_heads)
    cfg = dict(_configs.mixed_config(platform, head_size, block_g, bool(kv_fp8)))
    block_m = max(cfg.pop("BLOCK_M"), 16, block_g)
    config = dict(BLOCK_Q=block_m // block_g, BLOCK_G=block_g, DECODE_G=max(16, block_g), PART_ROWS=block_m,
                  BLOCK_DK=next_pow2(head_size), BLOCK_DV=next_pow2(head_size_v), **cfg)
    default_programs, target_items, default_budget, min_split = _configs.mixed_schedule(platform, num_kv_heads)
    split_budget = int(split_budget or default_budget)
    max_items = int(max_num_tokens) // config["BLOCK_Q"] + int(max_num_seqs) + split_budget
    programs = min(int(programs or default_programs), max_items * num_kv_heads)
    slots = 2 * split_budget
    items = torch.zeros(max_items, ITEM_FIELDS.value, dtype=torch.int32, device=device)
    if share is not None:
        _check_shared(share, (num_heads, num_kv_heads, head_size, head_size_v, device, split_budget))
        shared = dict(counts=share.counts, part_out=share.part_out, part_lse=share.part_lse, counters=share.counters)
    else:
        f32 = dict(dtype=torch.float32, device=device)
        shared = dict(counts=torch.zeros(4, dtype=torch.int32, device=device),
                      part_out=torch.empty(slots, num_kv_heads, block_m, config["BLOCK_DV"], **f32),
                      part_lse=torch.empty(slots, num_kv_heads, block_m, **f32),
                      counters=torch.zeros(slots, num_kv_heads, dtype=torch.int32, device=device))
    return MixedAttentionWorkspace(
        num_heads, num_kv_heads, head_size, head_size_v, int(max_num_tokens), int(max_num_seqs), device, config,
        programs, target_items, split_budget, min_split, items=items, **shared)


def _check_shared(share, want: tuple) -> None:
    if not isinstance(share, MixedAttentionWorkspace):
        raise TypeError(f"share must be a MixedAttentionWorkspace, got {type(share).__name__}")
    got = (share.num_heads, share.num_kv_heads, share.head_size, share.head_size_v, share.device, share.split_budget)
    if got != want:
        raise ValueError(f"share was made for (num_heads, num_kv_heads, head_size, head_size_v, device, "
                         f"split_budget) = {got}, the new workspace has {want}")


def plan_mixed_attention(workspace: MixedAttentionWorkspace, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, *,
                         window_left: int = -1, kv_split: int | None = None) -> None:
    """Write the step's work list into ``workspace`` (one launch of one program; once a step, for every layer).

    ``cu_seqlens_q [B + 1]`` and ``seq_lens [B]`` int32 as :func:`mixed_attention` takes them;
    ``window_left`` the layers' window (the pieces start at its first key); ``kv_split``: at most this many
    keys a piece (rounded up to the key tiles, and raised where the step would not fit the workspace); None:
    the cost model picks it on the device (:mod:`tripath.kernels.mixed_plan`)."""
    if not isinstance(workspace, MixedAttentionWorkspace):
        raise TypeError(f"workspace must be a MixedAttentionWorkspace, got {type(workspace).__name__}")
    device = workspace.device
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device, shape=(num_seqs,))
    if num_seqs > workspace.max_num_seqs:
        raise ValueError(f"cu_seqlens_q holds {num_seqs} requests, more than the workspace's max_num_seqs "
                         f"({workspace.max_num_seqs})")
    if int(window_left) < -1:
        raise ValueError(f"window_left must be -1 (off) or >= 0, got {window_left}")
    if kv_split is not None and int(kv_split) < 1:
        raise ValueError(f"kv_split must be at least 1 (or None: the cost model), got {kv_split}")
    workspace.window_left = int(window_left)
    if not use_triton(device):
        return
    cfg = workspace.config
    lanes = 16 if current_platform(device).backend == "cpu" else PLAN_LANES
    launch(
        plan_mixed_work_kernel, (1,),
        cu_seqlens_q, seq_lens, workspace.items, workspace.counts,
        num_seqs, workspace.max_num_tokens, int(kv_split or 0), workspace.min_split, workspace.target_items,
        workspace.split_budget, int(window_left),
        BLOCK_Q=cfg["BLOCK_Q"], BLOCK_N=cfg["BLOCK_N"], DECODE_BLOCK_N=cfg["DECODE_BLOCK_N"],
        BLOCK_C=lanes, BINARY_STEPS=_configs.binary_steps(num_seqs),
        HAS_WINDOW=window_left >= 0, num_warps=8,
    )


def _check_workspace(ws, q, num_kv_heads: int, head_size_v: int, num_seqs: int) -> None:
    if not isinstance(ws, MixedAttentionWorkspace):
        raise TypeError(f"workspace must be a MixedAttentionWorkspace, got {type(ws).__name__}")
    got = (ws.num_heads, ws.num_kv_heads, ws.head_size, ws.head_size_v)
    want = (q.shape[1], num_kv_heads, q.shape[2], head_size_v)
    if got != want:
        raise ValueError(f"workspace was made for (num_heads, num_kv_heads, head_size, head_size_v) = {got}, "
                         f"the inputs have {want}")
    if ws.device != q.device:
        raise ValueError(f"workspace is on {ws.device} but the inputs are on {q.device}")
    if q.shape[0] > ws.max_num_tokens or num_seqs > ws.max_num_seqs:
        raise ValueError(f"the step ({q.shape[0]} tokens, {num_seqs} requests) does not fit the workspace "
                         f"(max_num_tokens={ws.max_num_tokens}, max_num_seqs={ws.max_num_seqs})")


def mixed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, *, layout: str = "nhd",
                    sm_scale: float | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, window_left: int = -1, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    workspace: MixedAttentionWorkspace | None = None, planned: bool = False,
                    kv_split: int | None = None, max_num_tokens: int | None = None,
                    max_num_seqs: int | None = None, out: torch.Tensor | None = None, return_lse: bool = False,
                    validate: bool | None = None):
    """A mixed step's attention in one persistent launch (as :func:`tripath.ops.unified_attention` computes it).

    Parameters
    ----------
    q : ``[T, Hq, D]`` new tokens, request by request (``cu_seqlens_q [B + 1]`` int32 offsets); the batch is
        usually ordered [decode | extend | prefill], but any order works (requests of one new token take the
        decode tile).
    seq_lens : ``[B]`` int32, context + new tokens; new token ``t`` sits at ``seq_len - query_len + t`` and
        attends causally to the request's paged keys (its own K/V already in the cache).
    workspace : from :func:`mixed_attention_workspace`; None: one for this step (``max_num_tokens`` /
        ``max_num_seqs``, default ``T`` / ``B``), allocated here.
    planned : the workspace already holds this step's work list (:func:`plan_mixed_attention`, same
        ``window_left``): one launch. Otherwise the call plans first (``kv_split`` as there).
    validate : as :func:`tripath.ops.unified_attention`.

    Rows of ``q`` past ``cu_seqlens_q[-1]`` are not written. Returns ``out [T, Hq, Dv]`` (and ``lse [T, Hq]``).
    """
    device, block_size, num_kv_heads, head_size, head_size_v = check_paged(
        q, k_cache, v_cache, block_table, seq_lens, layout, k_scale, v_scale)
    group = check_attention_options(q, num_kv_heads, head_size, head_size_v, window_left, softcap, alibi_slopes,
                                    sinks, sm_scale)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if seq_lens.shape[0] != num_seqs or block_table.shape[0] < num_seqs:
        raise ValueError(f"seq_lens ({seq_lens.shape[0]}) and block_table ({block_table.shape[0]} rows) must "
                         f"have one entry per request of cu_seqlens_q ({num_seqs})")
    if planned:
        if workspace is None:
            raise ValueError("planned=True needs the workspace that holds the step's plan")
        if kv_split is not None:
            raise ValueError("kv_split is a planning choice: pass it to plan_mixed_attention, not with planned=True")
        if workspace.window_left != window_left:
            raise ValueError(f"the workspace's plan was made for window_left={workspace.window_left}, this call "
                             f"has window_left={window_left} (plan_mixed_attention with the layers' window)")
    if workspace is not None:
        _check_workspace(workspace, q, num_kv_heads, head_size_v, num_seqs)
    check_new_tokens_out(q, k_cache, block_table, seq_lens, cu_seqlens_q, block_size, head_size_v, out, validate)
    out_shape = (q.shape[0], q.shape[1], head_size_v)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_size)
    if not use_triton(device):
        return reference.unified_attention_ref(
            q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, layout=layout, sm_scale=sm_scale,
            k_scale=k_scale, v_scale=v_scale, window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes,
            sinks=sinks, out=out, return_lse=return_lse)
    if workspace is None:
        workspace = mixed_attention_workspace(q.shape[1], num_kv_heads, head_size, head_size_v=head_size_v,
                                              max_num_tokens=max(1, max_num_tokens or q.shape[0]),
                                              max_num_seqs=max(1, max_num_seqs or num_seqs), device=device,
                                              kv_fp8=k_cache.dtype in FP8_DTYPES)
        _check_workspace(workspace, q, num_kv_heads, head_size_v, num_seqs)
    if not planned:
        plan_mixed_attention(workspace, cu_seqlens_q, seq_lens, window_left=window_left, kv_split=kv_split)
    out = out if out is not None else torch.empty(out_shape, dtype=q.dtype, device=device)
    lse = lse_out(q.shape[0], q.shape[1], device, return_lse)
    q = q if q.stride(2) == 1 else q.contiguous()
    kv_fp8 = k_cache.dtype in FP8_DTYPES
    dummy = seq_lens
    ws = workspace
    launch(
        mixed_attention_kernel, (ws.programs,),
        q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
        ws.items, ws.counts, ws.part_out, ws.part_lse, ws.counters, out, lse,
        alibi_slopes if alibi_slopes is not None else dummy, sinks if sinks is not None else dummy,
        k_scale if kv_fp8 else dummy, v_scale if kv_fp8 else dummy,
        float(sm_scale), float(softcap), int(window_left),
        q.stride(0), q.stride(1), block_table.stride(0), *cache_strides(k_cache, v_cache),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        num_kv_heads, group, head_size, head_size_v, block_size,
        SHUFFLED=layout == "shuffled", X=shuffle_width(k_cache.dtype), KV_FP8=kv_fp8,
        HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
        HAS_SINKS=sinks is not None, RETURN_LSE=return_lse, **ws.config,
    )
    return (out, lse) if return_lse else out
