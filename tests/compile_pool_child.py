"""Run by tests/test_compile_pool.py in a process without the Triton interpreter: the JIT of a real tripath
kernel (RMSNorm) asks for sm_90 compilations through a stand-in driver (no GPU: ``warmup`` launches
nothing), collected by ``collect_compilations``, compiled by a ``CompilePool``, then asked again.
Prints one JSON line of what it saw."""

import json
import os
import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from tripath.kernels.rms_norm import rms_norm_kernel
from tripath.triton_internals import CompilePool, collect_compilations


class StandInDriver:
    """The one GPU of an sm_90 machine, as far as the JIT asks before it compiles."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def cache_entries() -> set:
    """The cache's compiled kernels (launch stubs, built where the GPU driver's library is, not counted)."""
    root = os.environ["TRITON_CACHE_DIR"]
    return {name for name in os.listdir(root)
            if any(f.endswith(".cubin") for f in os.listdir(os.path.join(root, name)))} if os.path.isdir(root) else set()


def ask(block_n: int, has_residual: bool):
    """What ``ops.norm.rms_norm`` launches for rows of ``block_n`` fp16 values (``warmup``: compile only)."""
    x = torch.zeros(4, block_n, dtype=torch.float16)
    w = torch.zeros(block_n, dtype=torch.float16)
    return rms_norm_kernel.warmup(x, x, w, x, x, 4, block_n, block_n, block_n, block_n, block_n, 1e-6,
                                  BLOCK_M=1, BLOCK_N=block_n, HAS_RESIDUAL=has_residual, num_warps=4, grid=(4,))


def main() -> int:
    driver.set_active(StandInDriver())
    variants = [(128, False), (256, True), (128, False)]  # the repeat is one compilation
    with collect_compilations() as found:
        skipped = [ask(*v) for v in variants]
    before = cache_entries()
    with CompilePool(int(sys.argv[1])) as pool:
        report = pool.compile(found)
    after_pool = cache_entries()
    compiled = [ask(*v) for v in variants]
    print(json.dumps({
        "found": len(found), "names": sorted({c.name for c in found}), "skipped_launches": skipped,
        "entries_before_pool": len(before), "entries_after_pool": len(after_pool),
        "entries_after_jit": len(cache_entries()), "pool_compiled": report.compiled, "pool_failed": report.failed,
        "pool_workers": report.workers, "jit_kernels": [type(k).__name__ for k in compiled],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
