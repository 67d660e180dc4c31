"""What each Triton kernel of the project is, for the portability check: whether it has a matrix stage
(:data:`KERNEL_ROLES`), and the findings accepted on purpose (:data:`DELIBERATE`, and the spill bounds under a
Triton other than the one the launch configurations were chosen on)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelRole:
    """Whether a kernel has a matrix-multiply stage (``tl.dot``) that must run on the matrix units
    (MFMA on CDNA, wgmma/mma on Hopper); ``why`` documents the answer in the report."""

    matrix_stage: bool
    why: str
    targets: tuple[str, ...] | None = None  # check-compile target names it is launched on; None: every target

    def runs_on(self, target: str) -> bool:
        return self.targets is None or target in self.targets


# Every Triton kernel of the project. An undeclared kernel fails the check; a declaration that disagrees
# with the compiled code (a tt.dot in a kernel declared elementwise, or none in a matrix kernel) fails too.
KERNEL_ROLES: dict[str, KernelRole] = {
    "varlen_attention_kernel": KernelRole(True, "QK^T and PV tiles"),
    "varlen_attention_sm90_kernel": KernelRole(True, "QK^T and PV on asynchronous warpgroup MMA (Gluon)",
                                               targets=("sm90",)),
    "paged_decode_kernel": KernelRole(True, "QK^T and PV over [BLOCK_G query heads x BLOCK_N tokens]"),
    "paged_verify_kernel": KernelRole(True, "QK^T and PV over [(token, head) rows of a request x BLOCK_N tokens]"),
    "unified_attention_kernel": KernelRole(True, "QK^T and PV over [(token, head) rows x BLOCK_N tokens]"),
    "mixed_attention_kernel": KernelRole(True, "QK^T and PV over decode and prompt tiles of a device-built work list"),
    "plan_mixed_work_kernel": KernelRole(False, "deliberate: the work list's prefix sums and stores, no matmul"),
    "reduce_splits_kernel": KernelRole(False, "deliberate: weighted sum of split partials, no matmul"),
    "merge_states_kernel": KernelRole(False, "deliberate: elementwise LSE merge, no matmul"),
    "write_kv_cache_kernel": KernelRole(False, "deliberate: row copy / fp8 quantising store, no matmul"),
    "gather_kv_cache_kernel": KernelRole(False, "deliberate: row gather / fp8 dequantising copy, no matmul"),
    "mla_decode_kernel": KernelRole(True, "heads packed into tiles: q·c^T (latent and rope parts) and P·c_lat"),
    "mla_verify_kernel": KernelRole(True, "(token, head) rows of a request: q·c^T (latent and rope parts) and "
                                          "P·c_lat"),
    "mla_decode_few_heads_sm90_kernel": KernelRole(True, "transposed products, loader warp (Gluon)",
                                                   targets=("sm90",)),
    "mla_decode_sm90_kernel": KernelRole(True, "scores once per tile, two value warpgroups (Gluon)",
                                         targets=("sm90",)),
    "concat_and_cache_mla_kernel": KernelRole(False, "deliberate: latent row write / fp8 quantising store"),
    "gather_mla_cache_kernel": KernelRole(False, "deliberate: latent row gather / fp8 dequantising copy"),
    "mla_prep_kernel": KernelRole(False, "deliberate: fused RoPE + concat + fp8 quantisation + cache write"),
    "rotary_embedding_kernel": KernelRole(False, "deliberate: in-place pair rotation"),
    "rms_norm_kernel": KernelRole(False, "deliberate: row reduction and scaling (residual add fused)"),
    "rms_norm_pair_kernel": KernelRole(False, "deliberate: two row reductions and scalings"),
    "rms_norm_rope_heads_kernel": KernelRole(False, "deliberate: per-head norm and pair rotation"),
    "silu_and_mul_kernel": KernelRole(False, "deliberate: elementwise gated activation"),
    "advance_decodes_kernel": KernelRole(False, "deliberate: per-row metadata update of multi-step decoding"),
    "lm_head_sample_kernel": KernelRole(True, "LM head tiles [BLOCK_V tokens x BLOCK_M rows] = W_tile · hᵀ"),
    "logits_sample_kernel": KernelRole(False, "deliberate: a pass over written logits (argmax / Gumbel keys, LSE)"),
    "skinny_gemm_kernel": KernelRole(True, "x [BLOCK_M rows] · W tile [BLOCK_N x BLOCK_K]ᵀ over a K split"),
    "sample_partials_reduce_kernel": KernelRole(False, "deliberate: per-row reduction of tile partials"),
}

# Findings accepted on purpose: (kernel, target name or "*", kind) -> reason. Kinds: "spill", "shared",
# "matrix", "compile". Empty means every kernel must compile cleanly everywhere.
DELIBERATE: dict[tuple[str, str, str], str] = {}


@dataclass(frozen=True)
class SpillBound:
    """The most a configuration may spill when compiled by another Triton than the one it was chosen on: AMD
    VGPR spills and scratch bytes, NVIDIA local-memory and spill-store bytes (per thread)."""

    vgpr_spills: int = 0
    scratch_bytes: int = 0
    spill_store_bytes: int = 0

    def holds(self, vgpr_spills: int | None, scratch_bytes: int | None, spill_store_bytes: int | None) -> bool:
        return ((vgpr_spills or 0) <= self.vgpr_spills and (scratch_bytes or 0) <= self.scratch_bytes
                and (spill_store_bytes or 0) <= self.spill_store_bytes)


# The launch configurations are chosen on Triton 3.6 (the GPU suite and the benchmarks run it). Another Triton
# allocates registers differently (3.9 assembles sm_90 code with CUDA 13's ptxas), and a few configurations
# then spill a little: within these bounds a spill under another Triton is reported (ok*), not failed.
CONFIGURED_ON_TRITON = (3, 6)
OTHER_TRITON_SPILLS = {"hip": SpillBound(vgpr_spills=8), "cuda": SpillBound(scratch_bytes=48, spill_store_bytes=48)}
# Larger spills accepted under another Triton, each with why: (kernel, target) -> (from Triton, bound, reason).
OTHER_TRITON_DELIBERATE: dict[tuple[str, str], tuple[tuple[int, int], SpillBound, str]] = {
    ("mla_decode_kernel", "sm90"): (
        (3, 9), SpillBound(scratch_bytes=160, spill_store_bytes=160),
        "the 64-head descriptor tile (the fallback of the Gluon MLA decode) holds a [64, 512] accumulator at the "
        "255-register cap; CUDA 13's ptxas spills up to 148 B there and no stage count avoids it"),
}
