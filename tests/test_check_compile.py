"""The portability check: every Triton kernel compiles for gfx942 / gfx950 / sm90 with the launch
configurations the launchers choose, without spills, with its matrix stages on the matrix units.

The CI subset (every kernel, every target) is compiled once per module by ``ci_report``; under
``TRITON_INTERPRET=1`` the compilations run in a child process without the interpreter. The other tests
check each piece against inputs whose answer is known: the JIT-equivalent signatures (fp8 flavour per
platform, AMD-only options), de-duplication, the readers of AMD/NVIDIA machine code on fixed text, the
verdicts on synthetic results, and the detectors on real compiler output of tiny kernels
(``tests/compile_toys.py``): an FMA-lowered dot, register spills, a compile error.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import compile_toys as toys
import tripath.kernels
from tripath import ops
from tripath.portability import check_compile as cc
from tripath.portability import compile_scenarios as scen
from tripath.portability import check_report
from tripath.portability import kernel_roles as roles
from tripath.portability.compile_inspect import (CompileResult, amd_code_stats, count_dots, count_fma_dots,
                                           cuobjdump_usage, ptx_matrix_instrs, ptxas_injected_waits,
                                           ptxas_spills, ptxas_wgmma_serialised)
from tripath.portability.compile_scenarios import Scenario
from tripath.portability.kernel_roles import KERNEL_ROLES
from tripath.triton_internals import launch
from tripath.platform import MI300X, fp8_dtype

ALL_TARGETS = tuple(cc.TARGETS)


def project_kernels() -> set[str]:
    """Every ``@triton.jit`` function named ``*_kernel`` in ``tripath.kernels`` (helpers are not kernels)."""
    names = set()
    for info in pkgutil.iter_modules(tripath.kernels.__path__):
        module = importlib.import_module(f"tripath.kernels.{info.name}")
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "fn") and obj.fn.__module__ == module.__name__:
                names.add(name)
    return names


def _kernels_on(target: str) -> set[str]:
    return {name for name, role in KERNEL_ROLES.items() if role.runs_on(target)}


@pytest.fixture(scope="module")
def ci_report() -> cc.CheckReport:
    return cc.run_check(subset="ci")


# --- the check itself, in CI ---------------------------------------------------------------------------

def test_ci_subset_compiles_cleanly_for_every_target(ci_report):
    failures = [f"{r.kernel} on {r.target} [{r.config}] ({r.scenarios[0]}): {kind}: {text}"
                for r in ci_report.results for kind, text in r.failures]
    failures += [f"scenario {e.scenario} on {e.target}: {e.error}" for e in ci_report.scenario_errors]
    assert not failures, "portability check failed:\n" + "\n".join(failures)
    assert ci_report.ok


def test_ci_subset_covers_every_kernel_on_every_target(ci_report):
    for target in ALL_TARGETS:
        compiled = {r.kernel for r in ci_report.results if r.target == target and not r.error}
        assert compiled == _kernels_on(target), (target, _kernels_on(target) ^ compiled)


def test_matrix_stages_use_the_matrix_units(ci_report):
    for r in ci_report.results:
        if r.error or not KERNEL_ROLES[r.kernel].matrix_stage:
            continue
        assert r.dots > 0 and r.fma_dots == 0 and r.matrix_instrs > 0, (r.kernel, r.target, r.config)
        assert r.matrix_kind == "MFMA" if r.target.startswith("gfx") else r.matrix_kind in ("wgmma", "mma",
                                                                                            "wgmma+mma")


def test_report_tables_list_every_kernel_and_target(ci_report):
    text = cc.format_report(ci_report)
    summary = check_report.summary_table(ci_report)
    for kernel in KERNEL_ROLES:
        for target in filter(KERNEL_ROLES[kernel].runs_on, ALL_TARGETS):
            assert any(line.startswith(f"| {kernel} ") and f"| {target} " in line for line in summary.splitlines())
    assert "matrix units" in summary and text.endswith(("OK", "FAILED"))


# --- declarations stay complete and honest -------------------------------------------------------------

def test_every_project_kernel_is_declared():
    assert project_kernels() == set(KERNEL_ROLES)


def test_ci_scenarios_launch_every_declared_kernel_on_every_target():
    jobs, errors = cc.collect_jobs(cc.select_scenarios("ci"), list(cc.TARGETS.values()))
    assert not errors
    for target in ALL_TARGETS:
        assert {j.name for j in jobs if j.target == target} == _kernels_on(target), target


def test_full_scenarios_build_for_every_target():
    jobs, errors = cc.collect_jobs(cc.select_scenarios("full"), list(cc.TARGETS.values()))
    assert not errors, errors
    assert all(j.launch_error is None for j in jobs)
    ci_jobs, _ = cc.collect_jobs(cc.select_scenarios("ci"), list(cc.TARGETS.values()))
    assert len(jobs) > 3 * len(ci_jobs)


# --- launches -> JIT-equivalent compile jobs -----------------------------------------------------------

def _jobs(name_part: str, target: str):
    scenarios = [s for s in scen.all_scenarios() if name_part in s.name]
    assert scenarios, name_part
    jobs, errors = cc.collect_jobs(scenarios, [cc.TARGETS[target]])
    assert not errors
    return jobs


@pytest.mark.parametrize("target, fp8_type", [("gfx942", "*fp8e4b8"), ("gfx950", "*fp8e4nv"), ("sm90", "*fp8e4nv")])
def test_fp8_cache_dtype_follows_the_platform(target, fp8_type):
    job = _jobs("kv write hd128 bf16 kv=fp8 shuffled", target)[0]
    sig = dict(job.signature)
    assert sig["k_cache_ptr"] == sig["v_cache_ptr"] == fp8_type
    assert sig["key_ptr"] == "*bf16"
    consts = dict(job.constexprs)
    assert consts["FP8_MAX"] == (240.0 if target == "gfx942" else 448.0) and consts["X"] == 16
    assert fp8_dtype(MI300X) is torch.float8_e4m3fnuz


def test_amd_knobs_reach_amd_targets_only():
    for target in ALL_TARGETS:
        job = _jobs("prefill hd128 bf16 causal", target)[0]
        options = dict(job.options)
        if target.startswith("gfx"):
            assert options["waves_per_eu"] >= 1 and options["matrix_instr_nonkdim"] == 16
        else:
            assert "waves_per_eu" not in options and "matrix_instr_nonkdim" not in options
        assert job.launch_error is None


def test_specialisation_matches_the_jit(monkeypatch):
    monkeypatch.setenv("TRIPATH_DISABLE_GLUON", "1")  # the portable kernel (sm_90 runs these on Gluon)
    job = _jobs("prefill hd128 bf16 causal", "sm90")[0]
    sig = dict(job.signature)
    assert sig["q_ptr"] == "*bf16" and sig["cu_seqlens_q_ptr"] == "*i32" and sig["qk_scale"] == "fp32"
    assert sig["BLOCK_M"] == "constexpr" and sig["sinks_ptr"] == "*i32"  # unused pointers get a dummy
    attrs = dict(job.attrs)
    names = [n for n, _ in job.signature]
    assert attrs[names.index("q_ptr")] == [["tt.divisibility", 16]]  # 16-byte aligned pointer
    assert attrs[names.index("stride_q_t")] == [["tt.divisibility", 16]]  # 32 heads x 128: divisible by 16
    # MHA: one query head per KV head folds num_queries_per_kv = 1 into a constant, as the JIT does.
    mha = cc.collect_jobs([Scenario("mha", lambda p: scen._build_varlen(
        p, head_size=64, dtype=torch.float16, causal=True, lse=False, num_heads=8,
        num_kv_heads=8))], [cc.TARGETS["sm90"]])[0][0]
    assert dict(mha.signature)["num_queries_per_kv"] == "constexpr"
    assert dict(mha.constexprs)["num_queries_per_kv"] == 1


def test_kv_caches_compile_as_production_sized_on_amd():
    """Caches are views of a > 2 GiB allocation, so AMD gets no 32-bit buffer-range attribute on them,
    while the step's small tensors keep it (as the JIT would decide on a serving GPU)."""
    job = _jobs("decode hd128 bf16 nhd splits=auto", "gfx942")[0]
    names = [n for n, _ in job.signature]
    attrs = dict(job.attrs)
    assert ["tt.pointer_range", 32] not in attrs[names.index("k_cache_ptr")]
    assert ["tt.pointer_range", 32] in attrs[names.index("q_ptr")]
    mla_job = _jobs("MLA decode packed H=16 kv=fp8", "gfx950")[0]
    assert ["tt.pointer_range", 32] not in dict(mla_job.attrs)[[n for n, _ in mla_job.signature].index("kv_cache_ptr")]


def _merge(tokens: int, head_size: int):
    def build(platform):
        out = torch.randn(tokens, 8, head_size)
        ops.merge_states(out, torch.randn(tokens, 8), out.clone(), torch.randn(tokens, 8))
    return build


def test_identical_compilations_are_deduplicated():
    scenarios = [Scenario("24 tokens", _merge(24, 128)), Scenario("40 tokens", _merge(40, 128)),
                 Scenario("head 64", _merge(24, 64))]
    jobs, errors = cc.collect_jobs(scenarios, [cc.TARGETS["gfx942"], cc.TARGETS["sm90"]])
    assert not errors and len(jobs) == 4
    for target in ("gfx942", "sm90"):
        by_head = {dict(j.constexprs)["BLOCK_D"]: j.scenarios for j in jobs if j.target == target}
        assert by_head == {128: ["24 tokens", "40 tokens"], 64: ["head 64"]}


def test_an_option_the_target_rejects_is_a_failure():
    def build(platform):
        a = torch.randn(32, 32)
        launch(toys.toy_matmul_kernel, (1,), a, a, a, BLOCK=32, PRECISION="tf32", waves_per_eu=2)

    jobs, _ = cc.collect_jobs([Scenario("amd knob on nvidia", build)], [cc.TARGETS["sm90"], cc.TARGETS["gfx942"]])
    by_target = {j.target: j for j in jobs}
    assert "waves_per_eu" in by_target["sm90"].launch_error and "cuda" in by_target["sm90"].launch_error
    assert by_target["gfx942"].launch_error is None
    result = cc.compile_jobs([by_target["sm90"]])[0]  # refused before compiling
    cc.evaluate(result, cc.TARGETS["sm90"])
    assert result.failures and result.failures[0][0] == "compile" and "waves_per_eu" in result.failures[0][1]


def test_empty_selection_and_unknown_target_are_refused():
    with pytest.raises(ValueError, match="no scenario matches"):
        cc.run_check(only="no such scenario")
    with pytest.raises(ValueError, match=r"targets \['sm80'\] are not supported; supported: gfx942, gfx950, sm90"):
        cc.run_check(targets=["sm80"])
    with pytest.raises(ValueError, match="subset='nightly' is not supported; supported: ci, full"):
        cc.select_scenarios("nightly")


# --- reading machine code ------------------------------------------------------------------------------

AMDGCN = """
  v_mfma_f32_16x16x16_bf16 a[0:3], v[2:3], v[4:5], a[0:3]
  v_mfma_f32_16x16x16_bf16 a[4:7], v[6:7], v[8:9], a[4:7]
  v_add_f32 v1, v2, v3
; Occupancy: 2
    .agpr_count:     16
    .group_segment_fixed_size: 32768
    .private_segment_fixed_size: 164
    .sgpr_count:     106
    .sgpr_spill_count: 16
    .vgpr_count:     256
    .vgpr_spill_count: 64
"""


def test_amd_code_stats():
    assert amd_code_stats(AMDGCN) == dict(vgprs=256, agprs=16, sgprs=106, vgpr_spills=64, sgpr_spills=16,
                                          scratch=164, lds=32768, occupancy=2, mfma=2)


def test_nvidia_readers():
    dump = ("Resource usage:\n Common:\n  GLOBAL:11 CONSTANT[4]:8\n Function k:\n"
            "  REG:212 STACK:8 SHARED:1024 LOCAL:216 CONSTANT[0]:680 TEXTURE:0\n")
    assert cuobjdump_usage(dump) == {"REG": 212, "STACK": 8, "SHARED": 1024, "LOCAL": 216}
    assert ptxas_spills("ptxas info    : Used 255 registers, 248 bytes spill stores, 244 bytes spill loads") == 248
    ptx = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {...};\nmma.sync.aligned.m16n8k16.row.col {...};"
    assert ptx_matrix_instrs(ptx) == (2, "wgmma+mma")
    assert ptx_matrix_instrs("fma.rn.f32 %f1, %f2, %f3, %f4;") == (0, "wgmma/mma")
    # ptxas -v on the Gluon MLA decode kernel with a score accumulator carried in flight across its loop's
    # back edge (2026-11-29; that build ran 1.4x slower on the H200)
    log = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the "
           "pipeline stage in the function 'mla_decode_sm90_kernel'\nptxas info    : Used 168 registers")
    assert ptxas_wgmma_serialised(log) == ["wgmma.mma_async instructions are serialized due to non wgmma "
                                           "instructions reading accumulator registers of  a wgmma between "
                                           "start and end of the pipeline stage"]
    assert ptxas_wgmma_serialised("ptxas info    : Used 168 registers, used 4 barriers") == []
    # ptxas -v on the seesaw MLA decode (branch wip/seesaw64, 2026-11-30; it ran 10% slower than the landed kernel)
    log = ("ptxas info    : (C7517) warpgroup.wait is injected in around line 3528 by compiler to allow use of "
           "registers defined by GMMA in function 'mla_decode_seesaw_sm90_kernel'\nptxas info    : Used 255 registers")
    assert ptxas_injected_waits(log) == 1 and ptxas_injected_waits("ptxas info    : Used 168 registers") == 0


def test_dot_counting_and_fma_detection():
    ttgir = """#blocked = #ttg.blocked<{sizePerThread = [1, 8]}>
#mma = #ttg.amd_mfma<{version = 3, instrShape = [16, 16, 16]}>
    %s = tt.dot %q, %k, %c : tensor<128x64xbf16, #a> * tensor<64x64xbf16, #b> -> tensor<128x64xf32, #mma> loc(#l)
    %t = tt.dot %p, %v, %d : tensor<16x16xf32, #a> * tensor<16x16xf32, #b> -> tensor<16x16xf32, #blocked> loc(#l)
    %u = ttng.warp_group_dot %p, %v, %d : !ttg.memdesc<64x64xf16> -> tensor<64x64xf32, #mma1>"""
    assert count_fma_dots(ttgir) == 1
    assert count_dots("%0 = tt.dot %a, %b, %c : x\n%1 = tt.dot %d, %e, %f : y\n%2 = arith.addf") == 2


# --- verdicts ------------------------------------------------------------------------------------------

def _result(kernel="varlen_attention_kernel", target="gfx942", triton=roles.CONFIGURED_ON_TRITON,
            **fields) -> CompileResult:
    base = dict(regs=128, sgprs=80, vgpr_spills=0, sgpr_spills=0, scratch_bytes=0, shared_bytes=1024, dots=2,
                fma_dots=0, matrix_instrs=64, matrix_kind="MFMA")
    if target == "sm90":
        base.update(sgprs=None, vgpr_spills=None, sgpr_spills=None, spill_store_bytes=0, matrix_kind="wgmma")
    base.update(fields)
    return cc.evaluate(CompileResult(kernel, target, "cfg", ["s"], **base), cc.TARGETS[target],
                       triton_version=triton)


def test_verdicts():
    assert _result().status == "ok"
    assert _result(vgpr_spills=3, scratch_bytes=16).failures == [("spill", "3 VGPR + 0 SGPR spills, 16 B scratch")]
    assert _result(target="sm90", scratch_bytes=24, spill_store_bytes=24).failures[0][0] == "spill"
    lane_only = _result(sgpr_spills=6)
    assert lane_only.status == "ok"
    for triton in (roles.CONFIGURED_ON_TRITON, (3, 9)):  # strict: no spill is accepted under any Triton
        strict = cc.evaluate(lane_only, cc.TARGETS["gfx942"], strict_sgpr=True, triton_version=triton)
        assert strict.failures == [("spill", "0 VGPR + 6 SGPR spills, 0 B scratch")]
    assert _result(shared_bytes=70 * 1024).failures[0][0] == "shared"  # over MI300X's 64 KiB LDS
    assert _result(target="gfx950", shared_bytes=70 * 1024).status == "ok"  # MI355X has 160 KiB
    assert _result(fma_dots=1).failures == [("matrix", "1 of 2 dots lowered to FMA")]
    assert _result(matrix_instrs=0).failures == [("matrix", "no MFMA instruction in the machine code")]
    assert _result(dots=0).failures[0] == ("matrix", "declared with a matrix stage but has no tt.dot")
    assert _result("merge_states_kernel", dots=0, matrix_instrs=0).status == "ok"
    assert "declares no matrix stage" in _result("merge_states_kernel", dots=1).failures[0][1]
    assert _result("mystery_kernel", dots=0).failures[0][0] == "undeclared"
    assert _result(error="NameError: x\nmore").failures == [("compile", "NameError: x")]
    injected = _result(target="sm90", injected_wgmma_waits=2)
    assert injected.failures == [("wgmma", "ptxas injected 2 warpgroup.wait (C7517): code reads a wgmma result "
                                           "while the product is in flight, so they do not overlap")]
    serialised = _result(target="sm90", serialised_wgmma=["wgmma.mma_async instructions are serialized"])
    assert serialised.failures == [("wgmma", "ptxas serialised the asynchronous wgmma: wgmma.mma_async "
                                             "instructions are serialized")]


def test_deliberate_findings_are_reported_not_failed(monkeypatch):
    monkeypatch.setitem(roles.DELIBERATE, ("varlen_attention_kernel", "gfx950", "spill"), "measured faster")
    assert _result(target="gfx950", vgpr_spills=2, scratch_bytes=8).status == "ok*"
    assert _result(target="gfx950", vgpr_spills=2, scratch_bytes=8).deliberate[0][1].endswith(
        "(deliberate: measured faster)")
    assert _result(target="gfx942", vgpr_spills=2, scratch_bytes=8).status == "FAIL"


def test_small_spills_under_another_triton_are_reported_not_failed():
    newer = (3, 9)
    assert newer != roles.CONFIGURED_ON_TRITON
    small_amd = _result(vgpr_spills=4, triton=newer)
    assert small_amd.status == "ok*" and "a small spill under Triton 3.9" in small_amd.deliberate[0][1]
    assert "chosen on Triton 3.6" in small_amd.deliberate[0][1]
    assert _result(vgpr_spills=4, scratch_bytes=16, triton=newer).status == "FAIL"  # AMD scratch: memory
    assert _result(vgpr_spills=9, triton=newer).status == "FAIL"
    assert _result(target="sm90", scratch_bytes=24, spill_store_bytes=24, triton=newer).status == "ok*"
    assert _result(target="sm90", scratch_bytes=24, spill_store_bytes=60, triton=newer).status == "FAIL"
    assert _result(vgpr_spills=4).status == "FAIL"  # on the Triton the configurations are chosen on


def test_documented_larger_spills_hold_from_their_triton_and_up_to_their_bound():
    spill = dict(kernel="mla_decode_kernel", target="sm90", scratch_bytes=152, spill_store_bytes=148)
    accepted = _result(triton=(3, 9), **spill)
    assert accepted.status == "ok*" and "255-register cap" in accepted.deliberate[0][1]
    assert _result(triton=(3, 8), **spill).status == "FAIL"  # the entry starts at Triton 3.9
    assert _result(triton=(3, 9), **{**spill, "spill_store_bytes": 400}).status == "FAIL"
    assert _result(triton=(3, 9), kernel="paged_decode_kernel", target="sm90", scratch_bytes=152,
                   spill_store_bytes=148).status == "FAIL"  # another kernel: the general bound


# --- the detectors on real compiler output -------------------------------------------------------------

def _toy_scenarios():
    def matmul(precision):
        def build(platform):
            a = torch.randn(32, 32)
            launch(toys.toy_matmul_kernel, (1,), a, a, a, BLOCK=32, PRECISION=precision, num_warps=4)
        return build

    def pressure(platform):
        x = torch.randn(9 * 2048)
        capped = {"maxnreg": 32} if platform.is_cuda else {"waves_per_eu": 8}
        launch(toys.toy_pressure_kernel, (1,), x, x, 7, BLOCK=1024 if platform.is_cuda else 2048, num_warps=4,
               **capped)

    def broken(platform):
        launch(toys.toy_broken_kernel, (1,), torch.randn(64), BLOCK=64)

    return [Scenario("ieee fp32 dot", matmul("ieee")), Scenario("tf32 dot", matmul("tf32")),
            Scenario("capped registers", pressure), Scenario("broken", broken)]


@pytest.fixture(scope="module")
def toy_report() -> cc.CheckReport:
    toys = {"toy_matmul_kernel": roles.KernelRole(True, "test"), "toy_pressure_kernel": roles.KernelRole(False, "test"),
            "toy_broken_kernel": roles.KernelRole(False, "test")}
    with pytest.MonkeyPatch.context() as mp:
        for name, role in toys.items():
            mp.setitem(KERNEL_ROLES, name, role)
        yield cc.run_check(scenarios=_toy_scenarios())


def _toy(report, kernel, target, scenario=None):
    found = [r for r in report.results if r.kernel == kernel and r.target == target
             and (scenario is None or scenario in r.scenarios)]
    assert len(found) == 1
    return found[0]


def test_fma_dot_is_caught_on_real_output(toy_report):
    ieee_nv = _toy(toy_report, "toy_matmul_kernel", "sm90", "ieee fp32 dot")
    assert ieee_nv.fma_dots == 1 and ("matrix", "1 of 1 dots lowered to FMA") in ieee_nv.failures
    tf32_nv = _toy(toy_report, "toy_matmul_kernel", "sm90", "tf32 dot")
    assert tf32_nv.status == "ok" and tf32_nv.matrix_instrs > 0
    for target in ("gfx942", "gfx950"):  # CDNA has fp32 MFMA: the ieee dot stays on the matrix cores
        r = _toy(toy_report, "toy_matmul_kernel", target, "ieee fp32 dot")
        assert r.status == "ok" and r.matrix_kind == "MFMA" and r.matrix_instrs > 0


def test_spills_are_caught_on_real_output(toy_report):
    for target in ALL_TARGETS:
        r = _toy(toy_report, "toy_pressure_kernel", target)
        assert [kind for kind, _ in r.failures] == ["spill"], (target, r.failures)
        assert r.scratch_bytes > 0
        if target == "sm90":
            assert r.regs <= 32 and r.spill_store_bytes > 0
        else:
            assert r.regs <= 64 and r.vgpr_spills > 0  # waves_per_eu=8 leaves 64 VGPRs


def test_compile_errors_are_reported_per_target(toy_report):
    for target in ALL_TARGETS:
        r = _toy(toy_report, "toy_broken_kernel", target)
        assert r.failures[0][0] == "compile" and "undefined_name is not defined" in r.failures[0][1]
    assert not toy_report.ok
    assert "toy_broken_kernel on gfx942" in cc.format_report(toy_report)


def test_main_exit_status(monkeypatch, capsys, tmp_path):
    assert cc.main_check_compile(["--subset", "ci", "--only", "merge", "--target", "sm90", "--summary",
                                  "--json", str(tmp_path / "r.json")]) == 0
    assert "merge_states_kernel | sm90" in capsys.readouterr().out
    monkeypatch.setattr(cc, "all_scenarios", lambda: _toy_scenarios()[3:])
    monkeypatch.setitem(KERNEL_ROLES, "toy_broken_kernel", roles.KernelRole(False, "test"))
    assert cc.main_check_compile(["--target", "gfx950", "--markdown", str(tmp_path / "r.md")]) == 1
    assert "FAILED" in (tmp_path / "r.md").read_text()
    with pytest.raises(SystemExit):
        cc.main_check_compile(["--only", "nothing matches this"])


def test_a_crashed_compile_worker_fails_its_jobs(monkeypatch):
    jobs, _ = cc.collect_jobs([Scenario("merge", _merge(8, 64))], [cc.TARGETS["gfx950"]])
    monkeypatch.setattr(cc.sys, "executable", "false")  # the child exits 1 without writing results
    results = cc.compile_jobs(jobs, workers=2)
    assert len(results) == 1 and results[0].error.startswith("compile worker exited with status 1")
    assert cc.evaluate(results[0], cc.TARGETS["gfx950"]).failures[0][0] == "compile"


def test_list_prints_the_distinct_compilations(capsys):
    assert cc.main_check_compile(["--list", "--subset", "ci", "--target", "sm90", "--only", "kv "]) == 0
    out = capsys.readouterr().out
    assert "write_kv_cache_kernel" in out and "gather_kv_cache_kernel" in out and "2 distinct compilations" in out
