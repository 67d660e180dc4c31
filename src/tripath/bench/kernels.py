"""``tripath bench kernels``: every op on Llama-3-8B, DeepSeek-R1 and LM-head shapes beside its floor and peers.

The LM head with the token draw is timed at the presets' LM-head shapes (:mod:`tripath.bench.kernels_lm_head`).

Floors are measured in the same run: device-to-device copy bandwidth (bytes read + written) for the
memory-bound decode, an 8192³ bf16 matmul for the compute-bound prefill. Bytes of a decode: K + V of
every context token, read once. FLOPs of a causal prefill: ``4 · S² · H · D / 2`` per sequence.
Times are medians of ``triton.testing.do_bench``; decode ops (paged and MLA, ~100-1000 µs) are timed as
GPU time of CUDA-graph replays, since an eager launch of such a kernel also measures Python on the host
(docs/BENCHMARKS.md, "Reproduce"). Each op is checked against its reference once.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from tripath.attention import AttentionSpec, select_backend
from tripath.bench import emit_report, require_gpu
from tripath.bench.batches import make_step
from tripath.bench.kernel_timing import (Report, Row, bench_eager, bench_graph, host_us, measure_floors,
                                         portable, power_capping_us, random_table)
from tripath.bench.kernels_lm_head import bench_lm_head, format_lm_head
from tripath.bench.kernels_mla import bench_mla_backends, bench_mla_decode, bench_mla_prefill, bench_mla_prep
from tripath.bench.kernels_verify import bench_mla_verify, bench_verify
from tripath.ops import mixed_attention, mixed_attention_workspace, paged_decode, varlen_attention
from tripath.ops.kv_cache import allocate_kv_cache, write_kv_cache
from tripath.platform import current_platform


def bench_decode(report: Report, shapes=((64, 1024), (64, 4096), (64, 16384), (8, 32768)),
                 heads=(32, 8), head_size=128, block_size=16, layouts=("nhd", "shuffled")) -> None:
    hq, hkv = heads
    dev = torch.device("cuda")
    for batch, ctx in shapes:
        table, num_blocks = random_table(batch, ctx, block_size, dev)
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
            us = bench_graph(lambda: paged_decode(q, k_cache, v_cache, table, seq_lens, layout=layout, out=out))
            report.rows.append(Row("decode", shape, f"tripath paged_decode ({layout})", us,
                                   nbytes / (us * 1e-6) / 1e9, "GB/s"))
            del k_cache, v_cache
        k = torch.randn(batch, hkv, ctx, head_size, dtype=torch.bfloat16, device=dev)
        v = torch.randn_like(k)
        qs = q.view(batch, hq, 1, head_size)
        us = bench_graph(lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True))
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
        us = bench_eager(run)
        shape = f"{batch} × {seq}"
        report.rows.append(Row("prefill", shape, "tripath varlen_attention", us, flops / (us * 1e-6) / 1e12, "TF/s"))
        # GPU time alone (replayed from a CUDA graph): an eager call that costs more host time than the GPU
        # work it queues is timed at its host cost.
        us = bench_graph(run)
        report.rows.append(Row("prefill", shape, "tripath varlen_attention, GPU time (CUDA graph)", us,
                               flops / (us * 1e-6) / 1e12, "TF/s"))
        if current_platform(dev).is_hopper:  # the portable Triton kernel the Gluon one replaces on sm_90
            us = bench_eager(portable(lambda: varlen_attention(q, k, v, cu, cu, seq, seq, causal=True, out=out)))
            report.rows.append(Row("prefill", shape, "tripath varlen_attention (portable Triton kernel)", us,
                                   flops / (us * 1e-6) / 1e12, "TF/s"))
        qs = q.view(batch, seq, hq, head_size).transpose(1, 2)
        ks = k.view(batch, seq, hkv, head_size).transpose(1, 2)
        vs = v.view(batch, seq, hkv, head_size).transpose(1, 2)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True,  # noqa: E731
                                                                        enable_gqa=True)
        us = bench_eager(sdpa)
        report.rows.append(Row("prefill", shape, "PyTorch SDPA", us, flops / (us * 1e-6) / 1e12, "TF/s"))
        us = bench_graph(sdpa)
        report.rows.append(Row("prefill", shape, "PyTorch SDPA, GPU time (CUDA graph)", us,
                               flops / (us * 1e-6) / 1e12, "TF/s"))
        # Host time a call: an eager do_bench row turns host-bound once it nears the GPU time of a call
        # plus the L2 flush.
        calls = [("tripath varlen_attention", run), ("PyTorch SDPA", sdpa)]
        if current_platform(dev).is_hopper:
            calls.insert(1, ("tripath varlen_attention (portable Triton kernel)", portable(run)))
        for name, fn in calls:
            us = host_us(fn)
            report.rows.append(Row("host", shape, name, us, us, "µs"))


MIXED_STEP = [(4096, 1)] * 48 + [(4096, 512)] * 8 + [(0, 2048)] * 2


def bench_mixed(report: Report, backends=("three_path", "unified", "two_path", "mixed"), layout="nhd") -> None:
    """The mixed step (48 decodes on 4096 cached tokens, 8 extends of 512 on 4096, 2 prefills of 2048;
    32/8/128 bf16) per backend, eager and as GPU time of a CUDA-graph replay; then the one-launch
    mixed attention on the same step (:func:`bench_mixed_one_launch`)."""
    spec = AttentionSpec(32, 8, 128, dtype=torch.bfloat16, kv_layout=layout)
    dev = torch.device("cuda")
    ref = select_backend(spec, "three_path", dev)
    step = make_step(spec, MIXED_STEP, ref, device=dev)
    outputs = {}
    for name in backends:
        backend = select_backend(spec, name, dev)
        meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
        cache = step.fresh_cache()
        out = torch.empty(step.q.shape[0], 32, 128, dtype=torch.bfloat16, device=dev)
        run_step = lambda: backend.forward(step.q, step.k, step.v, cache, meta, out=out)  # noqa: E731
        run_step()
        outputs[name] = out.clone()
        shown = f"{name} ({layout})"
        us = bench_eager(run_step)
        report.rows.append(Row("mixed", "48 dec + 8 ext + 2 pre", f"{shown}, eager", us, us / 1e3, "ms"))
        try:
            us = bench_graph(run_step)
        except Exception as exc:  # the eager time stands alone
            report.errors.append(f"bench_mixed: {name} not capturable: {type(exc).__name__}: {exc}")
            continue
        report.rows.append(Row("mixed", "48 dec + 8 ext + 2 pre", f"{shown}, CUDA graph (GPU time)", us,
                               us / 1e3, "ms"))
        del cache
    meta = ref.build_metadata(step.plan, step.block_table, step.slot_mapping)
    bench_mixed_one_launch(report, step, meta, layout, outputs.get("three_path"))
    torch.cuda.empty_cache()


def bench_mixed_one_launch(report: Report, step, meta, layout: str, reference: torch.Tensor | None) -> None:
    """The one-launch mixed attention (:func:`tripath.ops.mixed_attention`, issue 52) on the step of
    :func:`bench_mixed`: one forward as the backends' rows count it (KV write, the step's plan, the attention
    launch), and the attention launch alone (what each further layer of a planned step costs); eager and as
    GPU time of graph replays. Its output is checked against three_path's."""
    cache = step.fresh_cache()
    q = step.q
    ws = mixed_attention_workspace(32, 8, 128, max_num_tokens=q.shape[0], max_num_seqs=meta.seq_lens.shape[0],
                                   device=q.device)
    out = torch.empty(q.shape[0], 32, 128, dtype=q.dtype, device=q.device)

    def attend(planned: bool) -> None:
        mixed_attention(q, cache.k_cache, cache.v_cache, meta.block_table, meta.seq_lens, meta.cu_seqlens_q,
                        layout=layout, workspace=ws, planned=planned, out=out)

    def forward() -> None:
        write_kv_cache(step.k, step.v, cache.k_cache, cache.v_cache, meta.slot_mapping, layout=layout)
        attend(False)

    forward()
    if reference is not None and (err := (out.float() - reference.float()).abs().max().item()) > 2e-2:
        report.errors.append(f"bench_mixed_one_launch: disagrees with three_path (max error {err:.3g})")
    for shown, fn in ((f"one-launch mixed_attention ({layout}): write + plan + attend", forward),
                      (f"one-launch mixed_attention ({layout}): attend only (planned)", lambda: attend(True))):
        us = bench_eager(fn)
        report.rows.append(Row("mixed", "48 dec + 8 ext + 2 pre", f"{shown}, eager", us, us / 1e3, "ms"))
        us = bench_graph(fn)
        report.rows.append(Row("mixed", "48 dec + 8 ext + 2 pre", f"{shown}, CUDA graph (GPU time)", us, us / 1e3,
                               "ms"))


def check_correctness(report: Report) -> None:
    """One quick agreement check per op at benchmark dtype (bf16) before timing."""
    from tripath.ops import reference as R
    dev = torch.device("cuda")
    table, nb = random_table(4, 777, 16, dev)
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
                         ("verify", "Verify (batch × context × new tokens a request), 32/8/128, block 16, bf16"),
                         ("mla_verify", "MLA verify (heads · batch × context × new tokens), 576-wide rows, bf16"),
                         ("prefill", "Causal prefill (varlen), 32/8/128, bf16"),
                         ("host",
                          "Host time a call of the causal prefill rows (Python, checks, launch; GPU kept busy)"),
                         ("mixed", "Mixed step (48 dec + 8 ext + 2 pre), 32/8/128, bf16, one forward incl. KV write"),
                         ("mla", "MLA decode (absorbed, 576-wide rows, 512-wide values), bf16 cache"),
                         ("mla_prefill", "MLA prefill/extend attention (non-absorbed, 128 + 64 / 128), bf16"),
                         ("mla_prep", "MLA decode preparation, fp8 cache and query (speed-up of fused over unfused)"),
                         ("mla_backend", "MLA backends on whole steps (speed-up over mla_triton)"),
                         ("lm_head", "LM head + token draw, bf16 (weights read once; CUDA-graph replays)")):
        rows = [r for r in report.rows if r.table == table]
        if not rows:
            continue
        lines += [f"### {title}", ""]
        if table == "lm_head":
            lines += format_lm_head(rows, report.copy_gbps, _spread)
        elif table == "host":
            lines += ["| shape | implementation | host time a call |", "|---|---|---|"]
            lines += [f"| {r.shape} | {r.impl} | {r.us:.1f} µs{_spread(r)} |" for r in rows]
        elif table == "mixed":
            lines += ["| backend | time |", "|---|---|"]
            lines += [f"| {r.impl} | {r.us:.0f} µs{_spread(r)} |" for r in rows]
        elif table in ("mla_prep", "mla_backend"):
            lines += ["| shape | implementation | time | speed-up |", "|---|---|---|---|"]
            lines += [f"| {r.shape} | {r.impl} | {r.us:.2f} µs{_spread(r)} | {r.metric:.2f}× |" for r in rows]
        elif table in ("verify", "mla_verify"):   # each against the one-token decode of its batch and context
            decode = {r.shape.rsplit(" × ", 1)[0]: r.us for r in rows if r.shape.endswith(" × 1")}
            lines += ["| shape | kernel | time | GB/s | % of floor | time / decode's |", "|---|---|---|---|---|---|"]
            lines += [f"| {r.shape} | {r.impl} | {r.us:.1f} µs{_spread(r)} | {r.metric:.0f} | "
                      f"{100 * r.metric / report.copy_gbps:.0f}% | "
                      f"{r.us / decode[r.shape.rsplit(' × ', 1)[0]]:.2f}× |" for r in rows]
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


def run(sections=("decode", "verify", "prefill", "mixed", "mla", "lm_head"), repeat: int = 1) -> Report:
    """Run the sections (``repeat`` times, merged by :func:`merge_repeats`: run-to-run spread on the
    H200 reached 25% for identical memory-bound kernels, so single runs are not to be trusted alone)."""
    if repeat > 1:
        return merge_repeats([run(sections) for _ in range(repeat)])
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmarks need a GPU (CUDA or ROCm); on a CPU, `tripath bench` runs "
                           "every backend in Triton's interpreter")
    report = Report(device=torch.cuda.get_device_name())
    capped_before = power_capping_us()
    torch.manual_seed(0)
    began = time.perf_counter()
    check_correctness(report)
    measure_floors(report)
    print(f"== correctness and floors: {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    parts = {"decode": [bench_decode], "verify": [bench_verify, bench_mla_verify], "prefill": [bench_prefill],
             "mixed": [bench_mixed],
             "mla": [bench_mla_decode, bench_mla_prefill, bench_mla_prep, bench_mla_backends],
             "lm_head": [bench_lm_head]}
    for section in sections:
        for fn in parts[section]:
            began = time.perf_counter()
            try:
                fn(report)
            except Exception as exc:  # one broken section must not hide the others' numbers
                report.errors.append(f"{fn.__name__}: {type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()
            print(f"== {fn.__name__}: {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    capped_after = power_capping_us()
    if capped_before is not None and capped_after is not None:
        report.power_capped_s = (capped_after - capped_before) / 1e6
    return report


def main_kernels(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="tripath bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=["decode", "verify", "prefill", "mixed", "mla", "lm_head"],
                        choices=["decode", "verify", "prefill", "mixed", "mla", "lm_head"])
    parser.add_argument("--out", help="also write the markdown tables to this file")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run everything this many times; report medians and the range (default 1)")
    args = parser.parse_args(argv)
    require_gpu(parser)
    emit_report(format_report(run(tuple(args.only), repeat=max(1, args.repeat))), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_kernels())
