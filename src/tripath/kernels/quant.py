"""fp8 (e4m3) quantisation shared by the kernels that store into fp8 caches: ``sat(x)`` rounded to nearest
even.

On GPUs the conversion instruction rounds correctly. Triton's CPU interpreter (3.6) does not: it rounds
ties up and loses the carry into the exponent (31.5 → 16). With ``EMULATE_RNE`` (set by the launchers only
under the interpreter) the value is first rounded onto the e4m3 grid in fp32, so the conversion is exact.
"""

import triton
import triton.language as tl


@triton.jit
def fp8_round(x, FP8_MAX: tl.constexpr, EMULATE_RNE: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """Saturate ``x`` (fp32) to ±FP8_MAX; with ``EMULATE_RNE`` also round it to the e4m3 grid (3 mantissa
    bits; spacing ``2^(max(e, MIN_NORMAL_EXP) - 3)`` for ``|x|`` in ``[2^e, 2^(e+1))``)."""
    y = tl.clamp(x, -FP8_MAX, FP8_MAX)
    if EMULATE_RNE:
        e = tl.floor(tl.math.log2(tl.maximum(tl.abs(y), 1e-30)))
        step = tl.math.exp2(tl.maximum(e, MIN_NORMAL_EXP) - 3.0)
        r = y / step
        r = (r + 12582912.0) - 12582912.0  # round half to even in fp32 (|r| < 2^22)
        y = r * step
    return y
