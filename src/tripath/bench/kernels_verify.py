"""The verify rows of ``tripath bench kernels`` (``--only verify``): speculative decoding's verify steps, a few
new tokens per request against a paged context.

For each batch × context and ``n`` new tokens a request (1 is a plain decode), GPU time of CUDA-graph
replays of :func:`~tripath.ops.paged_verify` (``n > 1``) or :func:`~tripath.ops.paged_decode` (``n = 1``), and
of :func:`~tripath.ops.unified_attention` on the same batch (the decode slice's kernel where verifies are
longer than :data:`~tripath.ops.verify.MAX_VERIFY_TOKENS`), with the bandwidth of reading every context's K
and V once and the time against the one-token decode of the same batch (the target: at most 1.3x at 8 new
tokens). Llama-3-8B's attention: 32 query heads, 8 KV heads, 128 dims, bf16, 16-row blocks.
"""

from __future__ import annotations

import torch

from tripath.bench.kernel_timing import Report, Row, bench_graph, random_table
from tripath.ops import paged_decode, paged_verify, unified_attention
from tripath.ops.kv_cache import allocate_kv_cache

SHAPES = ((1, 4096), (8, 4096), (32, 4096), (8, 32768), (1, 131072))
NEW_TOKENS = (4, 8, 16)


def bench_verify(report: Report, shapes=SHAPES, new_tokens=NEW_TOKENS, heads=(32, 8), head_size=128,
                 block_size=16) -> None:
    hq, hkv = heads
    dev = torch.device("cuda")
    for batch, ctx in shapes:
        table, num_blocks = random_table(batch, ctx, block_size, dev)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, hkv, head_size, dtype=torch.bfloat16,
                                             device=dev)
        k_cache.normal_()
        v_cache.normal_()
        nbytes = 2 * batch * ctx * hkv * head_size * 2
        q1 = torch.randn(batch, hq, head_size, dtype=torch.bfloat16, device=dev)
        out1 = torch.empty_like(q1)
        decode_us = bench_graph(lambda: paged_decode(q1, k_cache, v_cache, table, seq_lens, out=out1))
        report.rows.append(Row("verify", f"{batch} × {ctx} × 1", "tripath paged_decode", decode_us,
                               nbytes / (decode_us * 1e-6) / 1e9, "GB/s"))
        for n in new_tokens:
            q = torch.randn(batch * n, hq, head_size, dtype=torch.bfloat16, device=dev)
            cu = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=dev)
            out = torch.empty_like(q)
            shape = f"{batch} × {ctx} × {n}"
            runs = (("tripath paged_verify",
                     lambda: paged_verify(q, k_cache, v_cache, table, seq_lens, cu, n, out=out)),
                    ("tripath unified_attention",
                     lambda: unified_attention(q, k_cache, v_cache, table, seq_lens, cu, n, out=out)))
            for name, fn in runs:
                us = bench_graph(fn)
                report.rows.append(Row("verify", shape, name, us, nbytes / (us * 1e-6) / 1e9, "GB/s"))
            del q, out
        del k_cache, v_cache
        torch.cuda.empty_cache()
