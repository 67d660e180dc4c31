"""The kernel benchmark's report merging (``tripath bench kernels --repeat N``), without a GPU."""

from tripath.bench.kernel_timing import Report, Row
from tripath.bench.kernels import format_report, merge_repeats


def test_repeats_merge_to_medians_with_ranges():
    runs = []
    for us, speedup in ((100.0, 2.0), (120.0, 1.8), (110.0, 2.2)):
        runs.append(Report("H200", copy_gbps=4000 + us, matmul_tflops=700, power_capped_s=us / 100,
                           rows=[Row("decode", "64 × 4096", "tripath", us, 4.4e5 / us, "GB/s"),
                                 Row("mixed", "step", "three_path", 10 * us, us / 100, "ms"),
                                 Row("mla_backend", "step", "mla", us / 10, speedup, "×"),
                                 Row("host", "16 × 512", "tripath", us / 2, us / 2, "µs")]))
    merged = merge_repeats(runs)
    decode, mixed, backend, host = merged.rows
    assert (decode.us, round(decode.metric), decode.note) == (110.0, 4000, "100.0–120.0")
    assert (mixed.us, mixed.metric) == (1100.0, 1.1)
    assert (backend.us, backend.metric) == (11.0, 2.0)
    assert (host.us, host.metric, host.note) == (55.0, 55.0, "50.0–60.0")
    assert merged.copy_gbps == 4110
    assert abs(merged.power_capped_s - 3.3) < 1e-9  # the runs' capping adds up
    text = format_report(merged)
    assert "| 64 × 4096 | tripath | 110.0 µs (100.0–120.0) | 4000 | 97% |" in text
    assert "| 16 × 512 | tripath | 55.0 µs (50.0–60.0) |" in text
    assert "capped the GPU's clocks for power for 3.3 s" in text


def test_verify_rows_are_read_against_the_decode_of_their_batch_and_context():
    report = Report("H200", copy_gbps=4000, matmul_tflops=700,
                    rows=[Row("verify", "8 × 4096 × 1", "tripath paged_decode", 20.0, 3200, "GB/s"),
                          Row("verify", "8 × 4096 × 8", "tripath paged_verify", 25.0, 2560, "GB/s"),
                          Row("verify", "1 × 131072 × 1", "tripath paged_decode", 80.0, 3400, "GB/s"),
                          Row("verify", "1 × 131072 × 8", "tripath unified_attention", 400.0, 680, "GB/s")])
    report.rows += [Row("mla_verify", "H=16 · 8 × 4096 × 1", "tripath mla_decode", 10.0, 3000, "GB/s"),
                    Row("mla_verify", "H=16 · 8 × 4096 × 4", "tripath mla_verify", 12.5, 2400, "GB/s")]
    text = format_report(report)
    assert "| 8 × 4096 × 8 | tripath paged_verify | 25.0 µs | 2560 | 64% | 1.25× |" in text
    assert "| 1 × 131072 × 8 | tripath unified_attention | 400.0 µs | 680 | 17% | 5.00× |" in text
    assert "### MLA verify" in text and "| H=16 · 8 × 4096 × 4 | tripath mla_verify | 12.5 µs | 2400 | 60% | 1.25× |" \
        in text


SMI_PERFORMANCE = """
==============NVSMI LOG==============
Attached GPUs                                          : 1
GPU 00000000:00:06.0
    Performance State                                  : P0
    Clocks Event Reasons
        Idle                                           : Active
        SW Power Cap                                   : Not Active
    Clocks Event Reasons Counters
        SW Power Capping                               : 26143061 us
        Sync Boost                                     : 0 us
"""


def test_power_capping_counter_is_parsed():
    from tripath.bench.kernel_timing import parse_power_capping_us
    assert parse_power_capping_us(SMI_PERFORMANCE) == 26143061.0
    assert parse_power_capping_us("no counters here") is None
    two_gpus = SMI_PERFORMANCE + SMI_PERFORMANCE.split("Attached GPUs")[1]
    assert parse_power_capping_us(two_gpus) is None


def test_gpu_benchmark_functions_name_only_defined_globals():
    """The GPU-only benchmark code never runs in the CPU suite, so check that every global name its functions
    load exists (a helper lost in an edit otherwise surfaces only as a NameError on the GPU)."""
    import builtins
    import dis
    import inspect

    import tripath.bench.kernels as kernels
    import tripath.bench.kernels_verify as kernels_verify
    import tripath.bench.tune as tune

    for module in (kernels, kernels_verify, tune):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            fn = inspect.unwrap(fn)
            if fn.__module__ != module.__name__:
                continue
            codes = [fn.__code__]
            while codes:
                code = codes.pop()
                codes += [c for c in code.co_consts if inspect.iscode(c)]
                missing = [ins.argval for ins in dis.get_instructions(code)
                           if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")
                           and ins.argval not in vars(module) and not hasattr(builtins, ins.argval)]
                assert not missing, f"{module.__name__}.{name} uses undefined globals {missing}"
