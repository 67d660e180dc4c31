"""``mla_triton``: the baseline MLA backend (the seed's TRITON_MLA role).

The same math as ``mla`` with the plain choices: the decode preparation runs unfused (in-place RoPE,
cache write and query concat / quantisation as separate launches) and the decode kernel is the per-head
split-KV kernel on CUDA cores (each head re-reads the latent rows). Prefill and extend are shared with
``mla`` (see :mod:`.mla_common`).
"""

from __future__ import annotations

from tripath.attention.backends.mla_common import MLABackendBase


class MLATritonBackend(MLABackendBase):
    name = "mla_triton"
    decode_variant = "per_head"
    fused_prep = False
