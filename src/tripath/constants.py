"""The values that more than one layer checks against, defined once (this module imports nothing, so a
config class can use them without loading torch's kernels or Triton)."""

# Head sizes every attention op serves (padded to a power of two inside the kernels).
MIN_HEAD_SIZE, MAX_HEAD_SIZE = 32, 256

# KV cache element types: "auto" = the model's dtype; "fp8" = the platform's e4m3 with per-tensor scales.
KV_CACHE_DTYPES = ("auto", "fp8")

# MHA KV cache layouts: "nhd" [num_blocks, block_size, num_kv_heads, head_size] and "shuffled" (16-byte
# vectors along head_size for K and along block_size for V; see tripath.ops.kv_cache).
KV_LAYOUTS = ("nhd", "shuffled")

# KV cache block sizes (rows per block) the built-in attention backends declare (Capabilities.block_sizes):
# powers of two up to 256, what their tuned kernel configurations are chosen for; and the block size an
# engine given none builds its spec with, unless its backend declares another (Capabilities.gpu_block_size).
BLOCK_SIZES = tuple(2 ** i for i in range(9))
DEFAULT_BLOCK_SIZE = 16
