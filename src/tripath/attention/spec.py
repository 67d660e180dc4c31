"""What a model's attention layer needs from a backend: :class:`AttentionSpec` (validated on construction),
the per-layer caches, and the MLA layer tensors.

MHA/GQA: ``num_heads`` query heads, ``num_kv_heads`` KV heads, ``head_size`` (and ``head_size_v``).
MLA: ``num_heads = H``, one latent KV head, ``head_size = L + R`` (576 for DeepSeek: 512 + 64) and
``mla`` set to the model's :class:`MLASpec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tripath.constants import DEFAULT_BLOCK_SIZE, KV_CACHE_DTYPES, KV_LAYOUTS, MAX_HEAD_SIZE, MIN_HEAD_SIZE

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class MLASpec:
    """Dims of multi-head latent attention (DeepSeek V2/V3/R1, Kimi): latent ``L``, rotary ``R``, per-head
    no-position ``P`` and value ``V`` sizes. ``rope`` is False for NoPE models (identity rotation)."""

    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rope: bool = True
    is_neox_rope: bool = False

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MLASpec.{name} must be positive, got {getattr(self, name)}")

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class AttentionSpec:
    """One model's attention, as every backend sees it.

    ``kv_cache_dtype``: ``"auto"`` (the model dtype) or ``"fp8"`` (e4m3 of the platform, per-tensor scales).
    ``kv_layout``: ``"nhd"`` or ``"shuffled"`` (MHA decode cache layout). ``decode_threshold``: requests
    with at most this many new tokens (and some context) are decodes (1, or 1 + speculative tokens).
    ``extend_chunk_budget``: tokens of cached context gathered per chunk, shared by a step's extends.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int | None = None
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_layout: str = "nhd"
    sm_scale: float | None = None
    window_left: int = -1
    softcap: float = 0.0
    use_alibi: bool = False
    use_sinks: bool = False
    decode_threshold: int = 1
    extend_chunk_budget: int = 32768
    mla: MLASpec | None = None

    def __post_init__(self):
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.mla is None:
            for name in ("head_size", "head_size_v"):
                size = getattr(self, name)
                if size is not None and not MIN_HEAD_SIZE <= size <= MAX_HEAD_SIZE:
                    raise ValueError(f"{name}={size} is not supported: head sizes {MIN_HEAD_SIZE}..{MAX_HEAD_SIZE}")
        else:
            if self.num_kv_heads != 1 or self.head_size != self.mla.cache_width:
                raise ValueError("an MLA spec has num_kv_heads=1 and head_size = kv_lora_rank + qk_rope_head_dim "
                                 f"({self.mla.cache_width}), got {self.num_kv_heads} and {self.head_size}")
        if self.dtype not in MODEL_DTYPES:
            raise TypeError(f"dtype={self.dtype} is not supported; supported: float16, bfloat16, float32")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}; supported: {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={self.kv_layout!r}; supported: {', '.join(KV_LAYOUTS)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.decode_threshold < 1:
            raise ValueError(f"decode_threshold must be >= 1, got {self.decode_threshold}")
        if self.extend_chunk_budget < 1:
            raise ValueError(f"extend_chunk_budget must be positive, got {self.extend_chunk_budget}")
        if self.window_left < -1 or self.softcap < 0:
            raise ValueError("window_left must be >= -1 and softcap >= 0")

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    @property
    def v_size(self) -> int:
        return self.head_size_v or self.head_size

    @property
    def features(self) -> frozenset[str]:
        """Optional features the spec uses (``window``, ``softcap``, ``alibi``, ``sinks``, ``fp8_kv``)."""
        used = set()
        if self.window_left >= 0:
            used.add("window")
        if self.softcap > 0:
            used.add("softcap")
        if self.use_alibi:
            used.add("alibi")
        if self.use_sinks:
            used.add("sinks")
        if self.kv_cache_dtype == "fp8":
            used.add("fp8_kv")
        return frozenset(used)


@dataclass
class KVCache:
    """One layer's paged MHA cache: K and V of ``layout`` plus the per-tensor fp8 scales (1.0 otherwise)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    layout: str = "nhd"
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass
class MLACache:
    """One layer's MLA cache ``[num_blocks, block_size, L + R]`` (rows ``[kv_c | rope(k_pe)]``), one scale."""

    kv_cache: torch.Tensor
    kv_scale: torch.Tensor | None = None


@dataclass
class RotaryTables:
    """cos/sin tables ``[max_position, R // 2]`` fp32 and the pairing (NeoX ``(i, i + R/2)`` or GPT-J
    interleaved ``(2i, 2i + 1)``)."""

    cos: torch.Tensor
    sin: torch.Tensor
    is_neox: bool = False


@dataclass
class MLALayerWeights:
    """The absorbed/up-projection weights of one MLA layer, split once from ``kv_b_proj``:
    ``w_uk [H, P, L]`` (``k_nope = W_UK · kv_c``) and ``w_uv [H, L, V]`` (``v = kv_c · W_UV``);
    ``rotary`` None for NoPE models.

    Both are views of one ``kv_b [H · (P + V), L]`` matrix in the layout of the model's ``kv_b_proj``
    weight (head ``h``'s rows: its ``P`` key rows, then its ``V`` value rows), so the non-absorbed
    up-projection is a single matmul, ``latent @ kv_b.T`` → ``[n, H, P + V]``. Given as views of such a
    matrix (:meth:`from_kv_b_proj`) nothing is copied; otherwise the two are copied into one once, here."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor
    rotary: RotaryTables | None = None
    q_scale: torch.Tensor | None = field(default=None)
    kv_b: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        if self.w_uk.dim() != 3 or self.w_uv.dim() != 3:
            raise ValueError(f"w_uk must be [H, P, L] and w_uv [H, L, V], got shapes {tuple(self.w_uk.shape)} "
                             f"and {tuple(self.w_uv.shape)}")
        heads, p_dim, lat = self.w_uk.shape
        if self.w_uv.shape[:2] != (heads, lat):
            raise ValueError(f"w_uv must be [H={heads}, L={lat}, V] to match w_uk, got {tuple(self.w_uv.shape)}")
        if self.w_uv.dtype != self.w_uk.dtype or self.w_uv.device != self.w_uk.device:
            raise ValueError("w_uk and w_uv must share a dtype and a device")
        v_dim = self.w_uv.shape[2]
        rows = p_dim + v_dim
        elem = self.w_uk.element_size()
        if not (self.w_uk.stride() == (rows * lat, lat, 1) and self.w_uv.stride() == (rows * lat, 1, lat)
                and self.w_uv.data_ptr() == self.w_uk.data_ptr() + p_dim * lat * elem):
            kv_b = torch.empty(heads, rows, lat, dtype=self.w_uk.dtype, device=self.w_uk.device)
            kv_b[:, :p_dim] = self.w_uk
            kv_b[:, p_dim:] = self.w_uv.transpose(1, 2)
            self.w_uk, self.w_uv = kv_b[:, :p_dim], kv_b[:, p_dim:].transpose(1, 2)
        self.kv_b = self.w_uk.as_strided((heads * rows, lat), (lat, 1))

    @classmethod
    def from_kv_b_proj(cls, weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, **kwargs):
        """Views of a ``kv_b_proj`` weight ``[H · (P + V), L]`` (no copy)."""
        if weight.dim() != 2 or weight.shape[0] % num_heads or not weight.is_contiguous():
            raise ValueError(f"kv_b_proj weight must be a contiguous [H * (P + V), L] matrix with H={num_heads}, "
                             f"got shape {tuple(weight.shape)}")
        kv_b = weight.view(num_heads, weight.shape[0] // num_heads, weight.shape[1])
        return cls(w_uk=kv_b[:, :qk_nope_head_dim], w_uv=kv_b[:, qk_nope_head_dim:].transpose(1, 2), **kwargs)
