"""Building blocks of the models, plain PyTorch: RMSNorm, rotary embedding, gated MLP, DeepSeek MoE.

- RMSNorm: ``y = w · x / sqrt(mean(x²) + eps)`` (statistics in fp32, cast back before the weight, as HF),
  optionally after the residual add; on a GPU one Triton kernel (:mod:`tripath.ops.norm`).
- RoPE: inverse frequencies ``θ^(-2i/R)`` for ``i < R/2`` (rescaled by ``linear``/``llama3``/``yarn``),
  angle ``pos · inv_freq[i]``; tables ``cos, sin [max_position, R/2]`` fp32 (times yarn's attention factor).
  NeoX pairs ``(x_i, x_{i+R/2})``, GPT-J pairs ``(x_{2i}, x_{2i+1})``; each pair ``(a, b)`` becomes
  ``(a·cos − b·sin, b·cos + a·sin)``.
- MLP: ``down(silu(gate(x)) · up(x))``, gate and up as one GEMM once the weights are loaded.
- MoE: router logits ``x·Wᵀ`` (fp32) → scores (softmax or sigmoid) → top-k experts per token (optionally
  group-limited) → weights (renormalised if configured, times ``routed_scaling_factor``) →
  ``Σ_k w_k · expert_k(x) + shared(x)``.

Under tensor parallelism (:mod:`tripath.models.parallel`) the MLP's gate/up are column-parallel and its down
row-parallel; an MoE layer keeps the rank's share of the routed experts (:class:`LocalExperts`) and sums its
partial output with the shared experts' in one all-reduce.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tripath.attention.spec import RotaryTables
from tripath.models.config import MoEConfig, RopeConfig, yarn_mscale
from tripath.models.parallel import SINGLE, ColumnParallelLinear, ParallelState, RowParallelLinear, Shard, equal_rows
from tripath.ops.activation import silu_and_mul, silu_and_mul_ref
from tripath.ops.linear import linear
from tripath.ops.norm import rms_norm, rms_norm_ref


class RMSNorm(nn.Module):
    """``forward(x)`` → the norm of ``x``; ``forward(x, residual)`` → ``(x + residual, its norm)``, the
    residual stream's new value and the next block's input. On a GPU one fused kernel
    (:func:`tripath.ops.norm.rms_norm`), elsewhere the same math in PyTorch."""

    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        norm = rms_norm if x.is_cuda else rms_norm_ref
        return norm(x, self.weight, self.eps, residual=residual)


# -- rotary ---------------------------------------------------------------------------------------------------

def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep the original frequency (extrapolate), 0: interpolate
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    if rope.attention_factor is not None:
        factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        factor = yarn_mscale(rope.factor)
    return inv_freq, factor


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2] fp32, attention_factor)`` of a rotary dim ``dim`` under ``rope``'s scaling."""
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position
        low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq, 1.0


def rotary_tables(rope: RopeConfig, dim: int, max_position: int, device=None) -> RotaryTables:
    """``cos``/``sin`` ``[max_position, dim/2]`` fp32 (yarn's attention factor folded in)."""
    inv_freq, factor = rope_inv_freq(rope, dim)
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return RotaryTables(cos=(angles.cos() * factor).to(device), sin=(angles.sin() * factor).to(device),
                        is_neox=rope.is_neox)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """Rotate the last dim of ``x [T, H, R]`` at ``positions [T]`` (fp32 math, result in ``x.dtype``)."""
    cos, sin = tables.cos[positions][:, None, :], tables.sin[positions][:, None, :]
    xf = x.float()
    if tables.is_neox:
        a, b = xf.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)
    a, b = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2).to(x.dtype)


# -- feed-forward ---------------------------------------------------------------------------------------------

def stack_linears(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight ``[sum of the rows, in]`` (and bias, where the linears have one) stacking ``linears``' rows
    in order; each linear's parameters become views of its row block, so memory holds one copy and the
    checkpoint names do not change."""
    weight = torch.cat([lin.weight.data for lin in linears])
    bias = torch.cat([lin.bias.data for lin in linears]) if linears[0].bias is not None else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[start:start + rows]
        if bias is not None:
            lin.bias.data = bias[start:start + rows]
        start += rows
    return weight, bias


class MLP(nn.Module):
    """Gated MLP; in parallel, gate/up column-parallel and down row-parallel over the intermediate size
    (``reduce=False``: the caller all-reduces the partial output).

    :meth:`fuse_weights` (called once the weights are loaded) stacks gate and up into one ``[2I, H]``
    weight whose two halves become the linears' weights, so a step runs one GEMM for both and one
    ``silu(gate) · up`` launch on a GPU (:func:`tripath.ops.activation.silu_and_mul`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False, dtype=None,
                 parallel: ParallelState = SINGLE, reduce: bool = True):
        super().__init__()
        rows = equal_rows(parallel, intermediate_size, "intermediate_size")
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, dtype=dtype, rows=rows)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, dtype=dtype, rows=rows)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, dtype=dtype, parallel=parallel,
                                           reduce=reduce, what="intermediate_size")
        self.register_buffer("gate_up_weight", None, persistent=False)  # set by fuse_weights
        self.register_buffer("gate_up_bias", None, persistent=False)

    def fuse_weights(self) -> None:
        """One weight (and bias) for gate and up; the linears' parameters become views of its halves."""
        weight, bias = stack_linears((self.gate_proj, self.up_proj))
        self.register_buffer("gate_up_weight", weight, persistent=False)
        self.register_buffer("gate_up_bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)
        return self.down_proj((silu_and_mul if x.is_cuda else silu_and_mul_ref)(gate_up))


class Router(nn.Module):
    """Top-k routing (fp32): returns ``(weights [T, K] fp32, expert ids [T, K] int64)``."""

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size, dtype=torch.float32))
        if moe.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Keep the experts of the ``topk_group`` best groups of ``choice [T, E]`` (the others get −inf)."""
        moe = self.moe
        grouped = choice.view(choice.shape[0], moe.n_group, -1)
        if moe.topk_method == "noaux_tc":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if moe.scoring_func == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if moe.topk_method != "greedy" and moe.n_group > 1:
            choice = self._mask_groups(choice)
        ids = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids


class Experts(nn.Module):
    """``num_experts`` gated MLPs stored stacked: ``gate_proj``/``up_proj [E, I, H]``, ``down_proj [E, H, I]``
    (``num_experts``: how many this module stores, default ``moe.num_experts``)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, dtype=None, num_experts: int | None = None):
        super().__init__()
        e, i = num_experts or moe.num_experts, moe.intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(e, i, hidden_size, dtype=dtype))
        self.up_proj = nn.Parameter(torch.empty(e, i, hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.gate_proj[e])) * F.linear(x, self.up_proj[e]), self.down_proj[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``Σ_k weights[t, k] · expert_{ids[t, k]}(x[t])`` in fp32 ``[T, H]``.

        Eagerly, tokens are grouped by expert (one host sync for the group sizes); while a CUDA graph is
        being captured, every expert runs on every token with a zero weight where it was not chosen.
        """
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.forward_dense(x, weights, ids)
        return self.forward_grouped(x, weights, ids)

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in range(self.gate_proj.shape[0]):
            w = (weights * (ids == e)).sum(-1, keepdim=True)
            out += w * self.expert(e, x).float()
        return out

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.gate_proj.shape[0]).tolist()[:self.gate_proj.shape[0]]
        top_k, start = ids.shape[1], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            picks = order[start:start + n]
            tokens = picks // top_k
            out.index_add_(0, tokens, self.expert(e, x[tokens]).float() * weights.flatten()[picks, None])
            start += n
        return out


class LocalExperts(Experts):
    """Experts ``first .. first + count - 1`` of ``moe.num_experts`` (a tensor-parallel rank's share): the sum
    over the chosen experts that live here (the others contribute 0)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, first: int, count: int, dtype=None):
        super().__init__(hidden_size, moe, dtype=dtype, num_experts=count)
        self.first = first
        self.tp_shards = {name: Shard(0, first, first + count, moe.num_experts)
                          for name in ("gate_proj", "up_proj", "down_proj")}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        count = self.gate_proj.shape[0]
        local = ids - self.first
        local = local.masked_fill((local < 0) | (local >= count), count)  # id `count`: not here, skipped
        return super().forward(x, weights, local)


class MoE(nn.Module):
    """DeepSeek MoE layer: ``gate`` (router), ``experts`` (routed) and ``shared_experts`` (dense). In parallel
    the router is replicated, the routed experts split across the ranks and the shared experts sharded as an
    MLP; one all-reduce sums both partial outputs."""

    def __init__(self, hidden_size: int, moe: MoEConfig, *, bias: bool = False, dtype=None,
                 parallel: ParallelState = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.gate = Router(hidden_size, moe)
        if parallel.is_parallel:
            first, stop = parallel.split(moe.num_experts, "the number of routed experts")
            self.experts = LocalExperts(hidden_size, moe, first, stop - first, dtype=dtype)
        else:
            self.experts = Experts(hidden_size, moe, dtype=dtype)
        self.shared_experts = (MLP(hidden_size, moe.intermediate_size * moe.num_shared_experts, bias=bias,
                                   dtype=dtype, parallel=parallel, reduce=False) if moe.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        out = out.to(x.dtype)
        return self.parallel.all_reduce(out) if self.parallel.is_parallel else out
