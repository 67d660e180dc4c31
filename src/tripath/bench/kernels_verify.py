"""The verify rows of ``tripath bench kernels`` (``--only verify``): speculative decoding's verify steps, a few
new tokens per request against a paged context.

For each batch × context and ``n`` new tokens a request (1 is a plain decode), GPU time of CUDA-graph
replays of :func:`~tripath.ops.paged_verify` (``n > 1``) or :func:`~tripath.ops.paged_decode` (``n = 1``), and
of :func:`~tripath.ops.unified_attention` on the same batch (the decode slice's kernel where verifies are
longer than :data:`~tripath.ops.verify.MAX_VERIFY_TOKENS`), with the bandwidth of reading every context's K
and V once and the time against the one-token decode of the same batch (the target: at most 1.3x at 8 new
tokens). Llama-3-8B's attention: 32 query heads, 8 KV heads, 128 dims, bf16, 16-row blocks. Where FlashInfer is
importable, its paged prefill wrapper (causal, a request's new tokens against its pages: the path peers take
for multi-token decodes) runs on the same cache and block tables beside them; a FlashInfer failure is
reported and leaves the other rows.

:func:`bench_mla_verify` (the same section, its own table): MLA's absorbed verify, DeepSeek's latent rows
(576 wide, 512-wide values, bf16, 64-row pages) at 16 heads (TP 8) and 128, against the one-token
:func:`~tripath.ops.mla_decode` of the batch: the decode kernel on a decode row a token (the MLA backends'
route for chains where the Gluon verify does not run) and :func:`~tripath.ops.mla_verify` (every token and head
of a request in one program: the Gluon kernel on sm_90, the backends' route there, and the portable kernel), with
the bandwidth of reading every context's rows once.
"""

from __future__ import annotations

import torch

from tripath.bench.kernel_timing import Report, Row, bench_graph, random_table
from tripath.ops import mla_decode, mla_verify, paged_decode, paged_verify, unified_attention
from tripath.ops.kv_cache import allocate_kv_cache
from tripath.ops.mla_verify import gluon_verify_applies

SHAPES = ((1, 4096), (8, 4096), (32, 4096), (8, 32768), (1, 131072))
NEW_TOKENS = (4, 8, 16)
MLA_SHAPES = ((8, 4096), (32, 4096), (8, 32768), (1, 131072))
MLA_SCALE = 1.0 / (128 + 64) ** 0.5


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
            try:
                run = flashinfer_verify(q, k_cache, v_cache, table, seq_lens, cu, hq, hkv, head_size, block_size)
                if run is not None:
                    us = bench_graph(run)
                    report.rows.append(Row("verify", shape, "FlashInfer paged prefill (causal)", us,
                                           nbytes / (us * 1e-6) / 1e9, "GB/s"))
            except Exception as exc:  # noqa: BLE001 - a peer's failure leaves tripath's rows
                report.errors.append(f"FlashInfer verify {shape}: {type(exc).__name__}: {exc}")
            del q, out
        del k_cache, v_cache
        torch.cuda.empty_cache()


def bench_mla_verify(report: Report, shapes=MLA_SHAPES, new_tokens=(4, 8), heads=(16, 128),
                     block_size: int = 64) -> None:
    dev = torch.device("cuda")
    for h in heads:
        for batch, ctx in shapes:
            table, num_blocks = random_table(batch, ctx, block_size, dev)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            cache = torch.randn(num_blocks, block_size, 576, dtype=torch.bfloat16, device=dev)
            nbytes = batch * ctx * 576 * 2
            q1 = torch.randn(batch, h, 576, dtype=torch.bfloat16, device=dev)
            out1 = torch.empty(batch, h, 512, dtype=torch.bfloat16, device=dev)
            decode_us = bench_graph(lambda: mla_decode(q1, cache, table, seq_lens, kv_lora_rank=512,
                                                       sm_scale=MLA_SCALE, out=out1))
            base = f"H={h} · {batch} × {ctx}"
            report.rows.append(Row("mla_verify", f"{base} × 1", "tripath mla_decode", decode_us,
                                   nbytes / (decode_us * 1e-6) / 1e9, "GB/s"))
            for n in new_tokens:
                q = torch.randn(batch * n, h, 576, dtype=torch.bfloat16, device=dev)
                cu = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=dev)
                out = torch.empty(batch * n, h, 512, dtype=torch.bfloat16, device=dev)
                rows_table = table.repeat_interleave(n, 0)   # a decode row a token, causal lengths
                rows_lens = (seq_lens[:, None] - n + 1 + torch.arange(n, device=dev)[None, :]).flatten().int()
                runs = (("tripath mla_decode, a row a token",
                         lambda: mla_decode(q, cache, rows_table, rows_lens, kv_lora_rank=512, sm_scale=MLA_SCALE,
                                            out=out)),
                        ("tripath mla_verify (Gluon, sm_90)",
                         lambda: mla_verify(q, cache, table, seq_lens, cu, n, kv_lora_rank=512, sm_scale=MLA_SCALE,
                                            out=out, variant="gluon")),
                        ("tripath mla_verify (portable kernel)",
                         lambda: mla_verify(q, cache, table, seq_lens, cu, n, kv_lora_rank=512, sm_scale=MLA_SCALE,
                                            out=out, variant="triton")))
                if not gluon_verify_applies(q, cache, 512, out):   # not sm_90: the Gluon kernel does not run
                    runs = runs[:1] + runs[2:]
                for name, fn in runs:
                    us = bench_graph(fn)
                    report.rows.append(Row("mla_verify", f"{base} × {n}", name, us, nbytes / (us * 1e-6) / 1e9,
                                           "GB/s"))
                del q, out
            del cache
            torch.cuda.empty_cache()


def flashinfer_verify(q, k_cache, v_cache, table, seq_lens, cu_seqlens_q, hq: int, hkv: int, head_size: int,
                      block_size: int):
    """FlashInfer's paged prefill over the same NHD cache (its pages are the blocks): a callable for the graph
    timer, planned once; None when FlashInfer is not importable."""
    try:
        import flashinfer
    except ImportError:
        return None
    batch, blocks = table.shape
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    pages_used = (seq_lens + block_size - 1) // block_size
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
    indptr[1:] = pages_used.cumsum(0)
    indices = torch.cat([table[b, :int(pages_used[b])] for b in range(batch)]).to(torch.int32)
    last = (seq_lens - (pages_used - 1) * block_size).to(torch.int32)
    wrapper.plan(cu_seqlens_q, indptr, indices, last, hq, hkv, head_size, block_size, causal=True,
                 q_data_type=q.dtype, kv_data_type=k_cache.dtype)
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, (k_cache, v_cache), out=out)
