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
# powers of two up to 256. The kernels' index arithmetic takes any size; powers of two are the sizes whose
# pages hold whole tiles and whole 16-byte vectors once large enough (the MLA decode's descriptor and Gluon
# paths, the shuffled layout), and the tests cover 1 to 64. DEFAULT_BLOCK_SIZE: what a backend prefers
# unless it declares another (Capabilities.cpu_block_size / gpu_block_size).
BLOCK_SIZES = tuple(2 ** i for i in range(9))
DEFAULT_BLOCK_SIZE = 16
