"""``mla``: the fast MLA backend (the role of ROCM_AITER_MLA among vLLM's ROCm attention backends).

Decode tokens take the absorbed path: ``q_nope · W_UK``, then the fused preparation kernel (RoPE, query
concat / fp8 quantisation and cache write in one launch) whenever :meth:`fused_prep_reasons` finds nothing
against it — otherwise the unfused ops run, with the same bits — then ``mla_decode(variant="auto")`` (the
warp-specialised Gluon kernel on sm_90 with 64 or 128 heads, the head-packed tensor-core kernel elsewhere)
and ``· W_UV``. Prefill and extend run non-absorbed (see :mod:`.mla_common`).
"""

from __future__ import annotations

from tripath.attention.backends.mla_common import MLABackendBase


class MLABackend(MLABackendBase):
    name = "mla"
    decode_variant = "auto"
    fused_prep = True

    def __init__(self, spec, device="cpu", *, fused_prep: bool = True):
        super().__init__(spec, device)
        self.fused_prep = fused_prep
