"""``mla_triton``: the baseline MLA backend (the role of TRITON_MLA among vLLM's attention backends).

The same math as ``mla`` with the plain choices: the decode preparation runs unfused (in-place RoPE,
cache write and query concat / quantisation as separate launches) and the decode kernel runs the plain
head-grouped configuration (16-head tensor-core tiles over the whole latent for every head count, the
design of SGLang's and vLLM's Triton MLA decode) instead of ``mla``'s per-head-count tuning. Prefill and
extend are shared with ``mla`` (see :mod:`.mla_common`).
"""

from __future__ import annotations

from tripath.attention.backends.mla_common import MLABackendBase


class MLATritonBackend(MLABackendBase):
    name = "mla_triton"
    decode_variant = "grouped"
    fused_prep = False
