"""fp8 (e4m3) quantisation shared by the kernels that store into fp8 caches: ``sat(x)`` rounded to nearest
even.

On GPUs the conversion instruction rounds correctly. Triton's CPU interpreter (3.6) does not: it rounds
ties up and loses the carry into the exponent (31.5 → 16). With ``EMULATE_RNE`` (set by the launchers only
under the interpreter) the value is first rounded onto the e4m3 grid in fp32, so the conversion is exact.
"""

import triton
import triton.language as tl


@triton.jit
def fp8_round(x, FP8_MAX: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Saturate ``x`` (fp32) to ±FP8_MAX; with ``EMULATE_RNE`` also round it onto the e4m3 grid."""
    y = tl.clamp(x, -FP8_MAX, FP8_MAX)
    if EMULATE_RNE:
        y = round_to_fp8_grid(y, FP8_MAX)
    return y


@triton.jit
def round_to_fp8_grid(x, FP8_MAX: tl.constexpr):
    """fp32 ``x`` (within ±FP8_MAX) rounded to the nearest e4m3 value, ties to even, still in fp32.

    The cast to e4m3 is then exact on every backend; Triton's interpreter otherwise drops the carry when
    rounding crosses a power of two (7.98 → 4.0). Normal range: keep 3 mantissa bits (round the 20 dropped
    bits to even); below the smallest normal (2^-6 for e4m3fn, max 448; 2^-7 for e4m3fnuz, max 240) the
    grid is uniform and ``(x + magic) - magic`` rounds onto it.
    """
    if FP8_MAX > 300.0:
        min_normal: tl.constexpr = 0.015625
        magic: tl.constexpr = 24576.0  # 1.5 * 2^14: its ulp is 2^-9, e4m3fn's subnormal step
    else:
        min_normal: tl.constexpr = 0.0078125
        magic: tl.constexpr = 12288.0  # 1.5 * 2^13: ulp 2^-10 (e4m3fnuz)
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = (tl.abs(x) + magic) - magic
    subnormal = (subnormal.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < min_normal, subnormal, normal)
