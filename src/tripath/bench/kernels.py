"""``tripath bench kernels``: every op on Llama-3-8B and DeepSeek-R1 shapes beside its floor and PyTorch SDPA.

Floors are measured in the same run: device-to-device copy bandwidth (bytes read + written) for the
memory-bound decode, an 8192³ bf16 matmul for the compute-bound prefill. Bytes of a decode: K + V of
every context token, read once. FLOPs of a causal prefill: ``4 · S² · H · D / 2`` per sequence.
Times are medians of ``triton.testing.do_bench``; decode ops (paged and MLA, ~100-1000 µs) are timed as
GPU time of CUDA-graph replays, since an eager launch of a 100 µs kernel also measures Python on the host
(an MLA decode of 95 µs GPU time reads 117-252 µs eagerly on an H200's host). Each op is checked
against its reference once.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from tripath import _env
from tripath.attention import AttentionSpec, select_backend
from tripath.bench import emit_report, require_gpu
from tripath.bench.batches import make_step
from tripath.ops import paged_decode, varlen_attention
from tripath.ops.kv_cache import allocate_kv_cache
from tripath.platform import current_platform


@dataclass
class Row:
    table: str
    shape: str
    impl: str
    us: float
    metric: float  # GB/s or TF/s
    unit: str
    note: str = ""


@dataclass
class Report:
    device: str
    copy_gbps: float = 0.0
    matmul_tflops: float = 0.0
    rows: list[Row] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    power_capped_s: float | None = None  # seconds the driver capped the clocks for power during the run


def parse_power_capping_us(performance_text: str) -> float | None:
    """The "SW Power Capping" counter (µs) of ``nvidia-smi -q -d PERFORMANCE`` output for one GPU, or None
    when the output has no such counter or describes several GPUs."""
    blocks = performance_text.split("Clocks Event Reasons Counters")
    if len(blocks) != 2:
        return None
    for line in blocks[1].splitlines():
        if "SW Power Capping" in line:
            try:
                return float(line.split(":", 1)[1].split()[0])
            except (IndexError, ValueError):
                return None
    return None


def _power_capping_us() -> float | None:
    """The driver's counter of time spent capping this machine's GPU clocks for power (µs), where
    ``nvidia-smi`` reports it for exactly one GPU. Sustained prefill load can cap an H200 for tens of
    seconds a minute, which moves compute-bound rows by a few percent, so the report states it."""
    import shutil
    import subprocess
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-q", "-d", "PERFORMANCE"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_power_capping_us(out.stdout)


def _bench(fn, reps_ms: int = 200) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=reps_ms, return_mode="median")) * 1e3  # us


def _bench_graph(fn) -> float:
    """Median µs of ``fn`` replayed from a CUDA graph: GPU time without Python launch overhead."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")) * 1e3


def _host_us(fn, calls: int = 100) -> float:
    """Host time of one call of ``fn`` (µs): ``calls`` calls issued while a sleep kernel keeps the GPU busy,
    so no call waits for the GPU and the wall time is Python, checks and launches alone."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e8))  # ~0.2 s of GPU clock cycles: longer than the calls take to issue
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _portable(fn):
    """``fn`` run with the Gluon kernels disabled (on sm_90: the portable Triton kernels they replace)."""
    def run():
        with _env.setting("TRIPATH_DISABLE_GLUON", "1"):
            return fn()
    return run


def measure_floors(report: Report) -> None:
    n = 1 << 29  # 1 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = _bench(lambda: dst.copy_(src))
    report.copy_gbps = 2 * n * 2 / (us * 1e-6) / 1e9
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    us = _bench(lambda: a @ b)
    report.matmul_tflops = 2 * 8192 ** 3 / (us * 1e-6) / 1e12


def _random_table(batch: int, ctx: int, block_size: int, device) -> tuple[torch.Tensor, int]:
    per = -(-ctx // block_size)
    num_blocks = batch * per + 1
    perm = torch.randperm(num_blocks - 1, device=device)[: batch * per] + 1
    return perm.view(batch, per).to(torch.int32), num_blocks


def bench_decode(report: Report, shapes=((64, 1024), (64, 4096), (64, 16384), (8, 32768)),
                 heads=(32, 8), head_size=128, block_size=16, layouts=("nhd", "shuffled")) -> None:
    hq, hkv = heads
    dev = torch.device("cuda")
    for batch, ctx in shapes:
        table, num_blocks = _random_table(batch, ctx, block_size, dev)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, hq, head_size, dtype=torch.bfloat16, device=dev)
        nbytes = 2 * batch * ctx * hkv * head_size * 2
        shape = f"{batch} × {ctx}"
        for layout in layouts:
            k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, hkv, head_size, dtype=torch.bfloat16,
                                                 layout=layout, device=dev)
            k_cache.normal_()
            v_cache.normal_()
            out = torch.empty_like(q)
            us = _bench_graph(lambda: paged_decode(q, k_cache, v_cache, table, seq_lens, layout=layout, out=out))
            report.rows.append(Row("decode", shape, f"tripath paged_decode ({layout})", us,
                                   nbytes / (us * 1e-6) / 1e9, "GB/s"))
            del k_cache, v_cache
        k = torch.randn(batch, hkv, ctx, head_size, dtype=torch.bfloat16, device=dev)
        v = torch.randn_like(k)
        qs = q.view(batch, hq, 1, head_size)
        us = _bench_graph(lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True))
        report.rows.append(Row("decode", shape, "PyTorch SDPA (contiguous K/V)", us, nbytes / (us * 1e-6) / 1e9,
                               "GB/s"))
        del k, v
        torch.cuda.empty_cache()


def bench_prefill(report: Report, shapes=((1, 8192), (8, 2048), (16, 512)), heads=(32, 8), head_size=128) -> None:
    hq, hkv = heads
    dev = torch.device("cuda")
    for batch, seq in shapes:
        q = torch.randn(batch * seq, hq, head_size, dtype=torch.bfloat16, device=dev)
        k = torch.randn(batch * seq, hkv, head_size, dtype=torch.bfloat16, device=dev)
        v = torch.randn_like(k)
        cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=dev)
        flops = batch * 4 * seq * seq * hq * head_size / 2
        out = torch.empty_like(q)
        run = lambda: varlen_attention(q, k, v, cu, cu, seq, seq, causal=True, out=out)  # noqa: E731
        us = _bench(run)
        shape = f"{batch} × {seq}"
        report.rows.append(Row("prefill", shape, "tripath varlen_attention", us, flops / (us * 1e-6) / 1e12, "TF/s"))
        # GPU time alone (replayed from a CUDA graph): an eager call that costs more host time than the GPU
        # work it queues is timed at its host cost.
        us = _bench_graph(run)
        report.rows.append(Row("prefill", shape, "tripath varlen_attention, GPU time (CUDA graph)", us,
                               flops / (us * 1e-6) / 1e12, "TF/s"))
        if current_platform(dev).is_hopper:  # the portable Triton kernel the Gluon one replaces on sm_90
            us = _bench(_portable(lambda: varlen_attention(q, k, v, cu, cu, seq, seq, causal=True, out=out)))
            report.rows.append(Row("prefill", shape, "tripath varlen_attention (portable Triton kernel)", us,
                                   flops / (us * 1e-6) / 1e12, "TF/s"))
        qs = q.view(batch, seq, hq, head_size).transpose(1, 2)
        ks = k.view(batch, seq, hkv, head_size).transpose(1, 2)
        vs = v.view(batch, seq, hkv, head_size).transpose(1, 2)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True,  # noqa: E731
                                                                        enable_gqa=True)
        us = _bench(sdpa)
        report.rows.append(Row("prefill", shape, "PyTorch SDPA", us, flops / (us * 1e-6) / 1e12, "TF/s"))
        us = _bench_graph(sdpa)
        report.rows.append(Row("prefill", shape, "PyTorch SDPA, GPU time (CUDA graph)", us,
                               flops / (us * 1e-6) / 1e12, "TF/s"))
        # Host time a call: an eager do_bench row turns host-bound once it nears the GPU time of a call
        # plus the L2 flush.
        calls = [("tripath varlen_attention", run), ("PyTorch SDPA", sdpa)]
        if current_platform(dev).is_hopper:
            calls.insert(1, ("tripath varlen_attention (portable Triton kernel)", _portable(run)))
        for name, fn in calls:
            us = _host_us(fn)
            report.rows.append(Row("host", shape, name, us, us, "µs"))


MIXED_STEP = [(4096, 1)] * 48 + [(4096, 512)] * 8 + [(0, 2048)] * 2


def bench_mixed(report: Report, backends=("three_path", "unified", "two_path"), layout="nhd") -> None:
    """The mixed step (48 decodes on 4096 cached tokens, 8 extends of 512 on 4096, 2 prefills of 2048;
    32/8/128 bf16) per backend, eager and as GPU time of a CUDA-graph replay."""
    spec = AttentionSpec(32, 8, 128, dtype=torch.bfloat16, kv_layout=layout)
    dev = torch.device("cuda")
    ref = select_backend(spec, "three_path", dev)
    step = make_step(spec, MIXED_STEP, ref, device=dev)
    for name in backends:
        backend = select_backend(spec, name, dev)
        meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
        cache = step.fresh_cache()
        out = torch.empty(step.q.shape[0], 32, 128, dtype=torch.bfloat16, device=dev)
        run_step = lambda: backend.forward(step.q, step.k, step.v, cache, meta, out=out)  # noqa: E731
        shown = f"{name} ({layout})"
        us = _bench(run_step)
        report.rows.append(Row("mixed", "48 dec + 8 ext + 2 pre", f"{shown}, eager", us, us / 1e3, "ms"))
        try:
            us = _bench_graph(run_step)
        except Exception as exc:  # the eager time stands alone
            report.errors.append(f"bench_mixed: {name} not capturable: {type(exc).__name__}: {exc}")
            continue
        report.rows.append(Row("mixed", "48 dec + 8 ext + 2 pre", f"{shown}, CUDA graph (GPU time)", us,
                               us / 1e3, "ms"))
        del cache
    torch.cuda.empty_cache()


def _mla_table(batch, ctx, block_size, dev, width=576):
    from tripath.ops.mla import allocate_mla_cache
    table, nb = _random_table(batch, ctx, block_size, dev)
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
        table, cache = _mla_table(batch, ctx, bs, dev)
        q = torch.randn(batch, heads, 576, dtype=torch.bfloat16, device=dev)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        nbytes = batch * ctx * 576 * 2
        flops = 2 * batch * heads * ctx * (576 + 512)
        gluon = (heads % 64 == 0 and bs % 32 == 0) or (heads in (8, 16, 32) and (bs % 64 == 0 or bs in (16, 32)))
        variants = ("packed", "grouped") + (("gluon",) if gluon else ())
        for variant in variants:
            try:
                us = _bench_graph(lambda: mla_decode(q, cache, table, sl, kv_lora_rank=512, sm_scale=0.07,
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

        t_fused, t_unfused = _bench_graph(fused), _bench_graph(unfused)
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
            runs["tripath varlen_attention (rotary part, portable Triton kernel)"] = _portable(
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
                us = _bench_graph(fn)
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
                    graph_us = _bench_graph(run_step)
                except Exception as exc:  # a step that cannot be captured still gets its eager time
                    report.errors.append(f"bench_mla_backends: {name} not capturable: {type(exc).__name__}: {exc}")
                    graph_us = float("nan")
                times[name] = (graph_us, _bench(run_step))
                del cache
            shape = f"{label}, H{heads}"
            for name, (graph_us, eager_us) in times.items():
                report.rows.append(Row("mla_backend", shape, f"{name} (CUDA graph: GPU time)", graph_us,
                                       times["mla_triton"][0] / graph_us, "×"))
                report.rows.append(Row("mla_backend", shape, f"{name} (eager, Python launches)", eager_us,
                                       times["mla_triton"][1] / eager_us, "×"))
            del step
            torch.cuda.empty_cache()


def check_correctness(report: Report) -> None:
    """One quick agreement check per op at benchmark dtype (bf16) before timing."""
    from tripath.ops import reference as R
    dev = torch.device("cuda")
    table, nb = _random_table(4, 777, 16, dev)
    kc, vc = allocate_kv_cache(nb, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    kc.normal_()
    vc.normal_()
    q = torch.randn(4, 32, 128, dtype=torch.bfloat16, device=dev)
    sl = torch.tensor([777, 1, 500, 64], dtype=torch.int32, device=dev)
    err = (paged_decode(q, kc, vc, table, sl).float() - R.paged_decode_ref(q, kc, vc, table, sl).float()).abs().max()
    if err > 2e-2:
        raise AssertionError(f"paged_decode disagrees with its reference on the GPU (max error {err:.3g})")


def _spread(row: Row) -> str:
    return f" ({row.note})" if row.note else ""


def format_report(report: Report) -> str:
    lines = [f"GPU: {report.device}. Floors measured in this run: copy **{report.copy_gbps:.0f} GB/s** "
             f"(read + write), bf16 8192³ matmul **{report.matmul_tflops:.0f} TFLOP/s**.", ""]
    if report.power_capped_s is not None:
        lines[0] += (f" The driver capped the GPU's clocks for power for {report.power_capped_s:.1f} s during the"
                     " run (nvidia-smi's SW Power Capping counter): compute-bound rows read low while it does.")
    for table, title in (("decode", "Paged decode, 32/8/128, block 16, bf16, random block order"),
                         ("prefill", "Causal prefill (varlen), 32/8/128, bf16"),
                         ("host", "Host time a call of the causal prefill rows (Python, checks, launch; GPU kept busy)"),
                         ("mixed", "Mixed step (48 dec + 8 ext + 2 pre), 32/8/128, bf16, one forward incl. KV write"),
                         ("mla", "MLA decode (absorbed, 576-wide rows, 512-wide values), bf16 cache"),
                         ("mla_prefill", "MLA prefill/extend attention (non-absorbed, 128 + 64 / 128), bf16"),
                         ("mla_prep", "MLA decode preparation, fp8 cache and query (speed-up of fused over unfused)"),
                         ("mla_backend", "MLA backends on whole steps (speed-up over mla_triton)")):
        rows = [r for r in report.rows if r.table == table]
        if not rows:
            continue
        lines += [f"### {title}", ""]
        if table == "host":
            lines += ["| shape | implementation | host time a call |", "|---|---|---|"]
            lines += [f"| {r.shape} | {r.impl} | {r.us:.1f} µs{_spread(r)} |" for r in rows]
        elif table == "mixed":
            lines += ["| backend | time |", "|---|---|"]
            lines += [f"| {r.impl} | {r.us:.0f} µs{_spread(r)} |" for r in rows]
        elif table in ("mla_prep", "mla_backend"):
            lines += ["| shape | implementation | time | speed-up |", "|---|---|---|---|"]
            lines += [f"| {r.shape} | {r.impl} | {r.us:.2f} µs{_spread(r)} | {r.metric:.2f}× |" for r in rows]
        elif table == "mla":
            lines += ["| heads, shape | kernel | time | rate | % of floor |", "|---|---|---|---|---|"]
            for r in rows:
                floor = report.copy_gbps if r.unit == "GB/s" else report.matmul_tflops
                lines.append(f"| {r.shape} | {r.impl} | {r.us:.1f} µs{_spread(r)} | {r.metric:.0f} {r.unit} | "
                             f"{100 * r.metric / floor:.0f}% |")
        else:
            floor = report.copy_gbps if table == "decode" else report.matmul_tflops
            lines += [f"| shape | implementation | time | {rows[0].unit} | % of floor |", "|---|---|---|---|---|"]
            lines += [f"| {r.shape} | {r.impl} | {r.us:.1f} µs{_spread(r)} | {r.metric:.0f} | "
                      f"{100 * r.metric / floor:.0f}% |"
                      for r in rows]
        lines.append("")
    lines += [f"**failed**: {e}" for e in report.errors]
    return "\n".join(lines)


def merge_repeats(reports: list[Report]) -> Report:
    """One report from ``len(reports)`` runs of the same sections: each row's median time over the runs
    (rates scaled to it; speed-ups the median of the runs' speed-ups), with the runs' range in ``note``."""
    capped = [r.power_capped_s for r in reports]
    merged = Report(device=reports[0].device, copy_gbps=statistics.median(r.copy_gbps for r in reports),
                    matmul_tflops=statistics.median(r.matmul_tflops for r in reports),
                    power_capped_s=None if None in capped else sum(capped))
    for row in reports[0].rows:
        same = [r for rep in reports for r in rep.rows
                if (r.table, r.shape, r.impl) == (row.table, row.shape, row.impl)]
        times = [r.us for r in same]
        us = statistics.median(times)
        if row.unit == "×":
            metric = statistics.median(r.metric for r in same)
        elif row.unit == "ms":
            metric = us / 1e3
        elif row.unit == "µs":
            metric = us
        else:
            metric = row.metric * row.us / us
        merged.rows.append(Row(row.table, row.shape, row.impl, us, metric, row.unit,
                               f"{min(times):.1f}–{max(times):.1f}" if len(same) > 1 else ""))
    for rep in reports:
        merged.errors += [e for e in rep.errors if e not in merged.errors]
    return merged


def run(sections=("decode", "prefill", "mixed", "mla"), repeat: int = 1) -> Report:
    """Run the sections (``repeat`` times, merged by :func:`merge_repeats`: run-to-run spread on the
    H200 reached 25% for identical memory-bound kernels, so single runs are not to be trusted alone)."""
    if repeat > 1:
        return merge_repeats([run(sections) for _ in range(repeat)])
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmarks need a GPU (CUDA or ROCm); on a CPU, `tripath bench` runs "
                           "every backend in Triton's interpreter")
    report = Report(device=torch.cuda.get_device_name())
    capped_before = _power_capping_us()
    torch.manual_seed(0)
    check_correctness(report)
    measure_floors(report)
    parts = {"decode": [bench_decode], "prefill": [bench_prefill], "mixed": [bench_mixed],
             "mla": [bench_mla_decode, bench_mla_prefill, bench_mla_prep, bench_mla_backends]}
    for section in sections:
        for fn in parts[section]:
            try:
                fn(report)
            except Exception as exc:  # one broken section must not hide the others' numbers
                report.errors.append(f"{fn.__name__}: {type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()
    capped_after = _power_capping_us()
    if capped_before is not None and capped_after is not None:
        report.power_capped_s = (capped_after - capped_before) / 1e6
    return report


def main_kernels(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="tripath bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=["decode", "prefill", "mixed", "mla"],
                        choices=["decode", "prefill", "mixed", "mla"])
    parser.add_argument("--out", help="also write the markdown tables to this file")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run everything this many times; report medians and the range (default 1)")
    args = parser.parse_args(argv)
    require_gpu(parser)
    emit_report(format_report(run(tuple(args.only), repeat=max(1, args.repeat))), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_kernels())
