"""Tiny Triton kernels for tests/test_check_compile.py: each makes one detector of the compile check fire on
real compiler output (an FMA-lowered dot, register spills, a compile error)."""

import triton
import triton.language as tl


@triton.jit
def toy_matmul_kernel(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """``C = A @ B`` on one ``[BLOCK, BLOCK]`` fp32 tile. ``PRECISION="ieee"`` has no tensor-core form on
    NVIDIA (the dot runs on FMA there) but maps to fp32 MFMA on CDNA; ``"tf32"`` uses the tensor cores."""
    rows = tl.arange(0, BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    c = tl.dot(tl.load(a_ptr + rows), tl.load(b_ptr + rows), input_precision=PRECISION)
    tl.store(c_ptr + rows, c)


@triton.jit
def toy_pressure_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Two ``[BLOCK]`` fp32 vectors live across a loop: spills once registers are capped
    (``maxnreg`` on NVIDIA, a high ``waves_per_eu`` on AMD)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    keep = tl.load(x_ptr + offs)
    for i in range(n):
        v = tl.load(x_ptr + (i + 1) * BLOCK + offs)
        acc = acc * keep + tl.sin(v) * tl.cos(acc + v)
        keep = keep + v * acc
    tl.store(out_ptr + offs, acc + keep)


@triton.jit
def toy_broken_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + undefined_name)  # noqa: F821
