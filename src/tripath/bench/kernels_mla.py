"""The MLA rows of ``tripath bench kernels``: the absorbed decode, the fused decode preparation against its
unfused steps, the non-absorbed prefill against SDPA, and the MLA backends on whole steps."""

from __future__ import annotations

import torch

from tripath.attention import AttentionSpec, select_backend
from tripath.bench.kernel_timing import Report, Row, bench_eager, bench_graph, portable, random_table
from tripath.ops import varlen_attention
from tripath.platform import current_platform


def mla_table(batch, ctx, block_size, dev, width=576):
    from tripath.ops.mla import allocate_mla_cache
    table, nb = random_table(batch, ctx, block_size, dev)
    cache = allocate_mla_cache(nb, block_size, dtype=torch.bfloat16, device=dev)
    cache.normal_()
    return table, cache


def bench_mla_decode(report: Report) -> None:
    """Absorbed MLA decode: the warp-specialised Gluon kernels (``mla`` on sm_90: 8/16/32 heads and multiples
    of 64), the tuned head-packed configuration (``mla`` elsewhere) and the plain 16-head grouped one
    (``mla_triton``; the one-head-per-program variant is far slower and left out)."""
    from tripath.ops import mla_decode
    dev = torch.device("cuda")
    cases = [(16, 64, 4096, 64), (16, 64, 16384, 64), (16, 8, 32768, 64), (16, 64, 4096, 16), (128, 64, 4096, 64)]
    for heads, batch, ctx, bs in cases:
        table, cache = mla_table(batch, ctx, bs, dev)
        q = torch.randn(batch, heads, 576, dtype=torch.bfloat16, device=dev)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        nbytes = batch * ctx * 576 * 2
        flops = 2 * batch * heads * ctx * (576 + 512)
        gluon = (heads % 64 == 0 and bs % 32 == 0) or (heads in (8, 16, 32) and (bs % 64 == 0 or bs in (16, 32)))
        variants = ("packed", "grouped") + (("gluon",) if gluon else ())
        for variant in variants:
            try:
                us = bench_graph(lambda: mla_decode(q, cache, table, sl, kv_lora_rank=512, sm_scale=0.07,
                                                     variant=variant))
            except ValueError as exc:  # "gluon" off sm_90 or with TRIPATH_DISABLE_GLUON
                report.errors.append(f"bench_mla_decode: {variant}: {exc}")
                continue
            compute_bound = heads >= 64
            report.rows.append(Row("mla", f"H{heads}, {batch} × {ctx}, block {bs}", f"mla_decode ({variant})", us,
                                   flops / (us * 1e-6) / 1e12 if compute_bound else nbytes / (us * 1e-6) / 1e9,
                                   "TF/s" if compute_bound else "GB/s"))
        del cache
        torch.cuda.empty_cache()


def bench_mla_prep(report: Report) -> None:
    """Decode preparation: the fused kernel (one launch) vs RoPE + cache write + query concat/quantise,
    each replayed from a CUDA graph (as decode steps run in serving), so launch overhead is excluded."""
    from tripath.ops import concat_and_cache_mla, concat_mla_query, fused_qk_rope_concat_and_cache_mla, \
        rotary_embedding
    from tripath.ops.mla import allocate_mla_cache
    from tripath.platform import fp8_dtype
    dev = torch.device("cuda")
    fp8 = fp8_dtype()
    max_pos = 8192
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device=dev).float() / 64))
    freqs = torch.outer(torch.arange(max_pos, device=dev).float(), inv)
    cos, sin = freqs.cos(), freqs.sin()
    for tokens, heads in ((64, 16), (256, 16), (64, 128), (256, 128)):
        cache = allocate_mla_cache(tokens // 16 + 2, 16, dtype=fp8, device=dev)
        slots = torch.arange(16, 16 + tokens, device=dev)
        pos = torch.randint(0, max_pos, (tokens,), device=dev)
        ql = torch.randn(tokens, heads, 512, dtype=torch.bfloat16, device=dev)
        q_pe = torch.randn(tokens, heads, 64, dtype=torch.bfloat16, device=dev)
        kv_c = torch.randn(tokens, 512, dtype=torch.bfloat16, device=dev)
        k_pe = torch.randn(tokens, 64, dtype=torch.bfloat16, device=dev)
        q_out = torch.empty(tokens, heads, 576, dtype=fp8, device=dev)
        scale = torch.tensor([0.05], device=dev)

        def fused():
            fused_qk_rope_concat_and_cache_mla(ql, q_pe, kv_c, k_pe, cache, q_out, slots, scale, scale, pos, cos,
                                               sin, is_neox=False, is_nope_first=True)

        def unfused():
            rotary_embedding(pos, q_pe, k_pe, (cos, sin), is_neox=False)
            concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_scale=scale)
            concat_mla_query(ql, q_pe, q_out, q_scale=scale)

        t_fused, t_unfused = bench_graph(fused), bench_graph(unfused)
        shape = f"T {tokens}, H {heads}"
        report.rows.append(Row("mla_prep", shape, "fused (1 launch)", t_fused, t_unfused / t_fused, "×"))
        report.rows.append(Row("mla_prep", shape, "unfused (3 launches)", t_unfused, 1.0, "×"))


def bench_mla_prefill(report: Report) -> None:
    """MLA's non-absorbed prefill/extend attention (queries and keys 128 + 64 wide, values 128, one rotary
    key shared by the heads; keys and values strided as the up-projection leaves them): the rotary part
    scored separately (``q_rope``/``k_rope``, the backends' path), and PyTorch SDPA on the concatenated
    192-wide heads. FLOPs count the causal
    triangle only: ``2 · keys seen · H · (192 + 128)``."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    dev = torch.device("cuda")
    for heads, nreq, nq, nk in ((128, 2, 2048, 2048), (128, 4, 512, 4608), (16, 8, 2048, 2048)):
        q = torch.randn(nreq * nq, heads, 192, dtype=torch.bfloat16, device=dev)
        kv = torch.randn(nreq * nk, heads, 256, dtype=torch.bfloat16, device=dev)  # [k_nope | v] per head
        k_pe = torch.randn(nreq * nk, 1, 64, dtype=torch.bfloat16, device=dev)
        q_nope, q_rope, k_nope, v = q[..., :128], q[..., 128:].contiguous(), kv[..., :128], kv[..., 128:]
        cq = torch.arange(0, (nreq + 1) * nq, nq, dtype=torch.int32, device=dev)
        ck = torch.arange(0, (nreq + 1) * nk, nk, dtype=torch.int32, device=dev)
        seen = nreq * (nq * (nk - nq) + nq * (nq + 1) / 2)
        flops = 2 * seen * heads * (192 + 128)
        k_cat = torch.cat([k_nope, k_pe.expand(-1, heads, -1)], dim=-1)
        shape = f"H{heads}, {nreq} × {nq} on {nk} keys"
        runs = {
            "tripath varlen_attention (rotary part)": lambda: varlen_attention(
                q_nope, k_nope, v, cq, ck, nq, nk, causal=True, sm_scale=0.07, q_rope=q_rope, k_rope=k_pe),
        }
        if current_platform(dev).is_hopper:  # the portable Triton kernel the Gluon one replaces on sm_90
            runs["tripath varlen_attention (rotary part, portable Triton kernel)"] = portable(
                runs["tripath varlen_attention (rotary part)"])
        qs = q.view(nreq, nq, heads, 192).transpose(1, 2)
        ks = k_cat.reshape(nreq, nk, heads, 192).transpose(1, 2)
        vs = v.reshape(nreq, nk, heads, 128).transpose(1, 2)
        # SDPA's is_causal is top-left aligned; with a context before the queries give it the mask instead
        mask = None if nq == nk else (torch.arange(nk, device=dev)[None, :]
                                      <= torch.arange(nk - nq, nk, device=dev)[:, None])
        runs["PyTorch SDPA (192-wide heads)"] = lambda: sdpa(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                                            scale=0.07)
        for impl, fn in runs.items():
            try:
                us = bench_graph(fn)
            except Exception as exc:  # SDPA may have no kernel for 192/128 heads on this build
                report.errors.append(f"bench_mla_prefill: {impl} at {shape}: {type(exc).__name__}: {exc}")
                continue
            report.rows.append(Row("mla_prefill", shape, impl, us, flops / (us * 1e-6) / 1e12, "TF/s"))
        del q, kv, k_pe, k_cat
        torch.cuda.empty_cache()


def bench_mla_backends(report: Report) -> None:
    """``mla`` vs ``mla_triton`` on MLA steps, DeepSeek-R1 attention at TP 8 (16 heads) and at TP 1 (128
    heads): a decode-heavy step, and one of decodes beside extends of 512 tokens on 4096 cached (chunked
    context up-projected from the latent cache), as GPU time (CUDA-graph replay) and as eager time (Python
    launches included)."""
    from tripath.attention import MLASpec
    from tripath.attention.backends.torch_ref import TorchBackend
    from tripath.bench.batches import make_mla_step
    dev = torch.device("cuda")
    steps = {"64 dec (4096) + 2 pre (512)": [(4096, 1)] * 64 + [(0, 512)] * 2,
             "32 dec (4096) + 4 ext (4096 + 512)": [(4096, 1)] * 32 + [(4096, 512)] * 4}
    for heads in (16, 128):
        spec = AttentionSpec(heads, 1, 576, dtype=torch.bfloat16, block_size=64, mla=MLASpec())
        for label, requests in steps.items():
            step = make_mla_step(spec, requests, TorchBackend(spec, dev), device=dev)
            args = (step.q_nope, step.q_pe, step.kv_c, step.k_pe, step.positions)
            times = {}
            for name in ("mla", "mla_triton"):
                backend = select_backend(spec, name, dev)
                meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
                cache = step.fresh_cache()
                run_step = lambda: backend.forward_mla(*args, cache, meta, step.weights)  # noqa: E731
                try:
                    graph_us = bench_graph(run_step)
                except Exception as exc:  # a step that cannot be captured still gets its eager time
                    report.errors.append(f"bench_mla_backends: {name} not capturable: {type(exc).__name__}: {exc}")
                    graph_us = float("nan")
                times[name] = (graph_us, bench_eager(run_step))
                del cache
            shape = f"{label}, H{heads}"
            for name, (graph_us, eager_us) in times.items():
                report.rows.append(Row("mla_backend", shape, f"{name} (CUDA graph: GPU time)", graph_us,
                                       times["mla_triton"][0] / graph_us, "×"))
                report.rows.append(Row("mla_backend", shape, f"{name} (eager, Python launches)", eager_us,
                                       times["mla_triton"][1] / eager_us, "×"))
            del step
            torch.cuda.empty_cache()
