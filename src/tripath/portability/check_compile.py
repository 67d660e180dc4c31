"""``tripath check-compile``: compile every Triton kernel for AMD MI300/MI355 and NVIDIA Hopper, on any machine.

For each target (gfx942 = MI300X/MI325X, gfx950 = MI355X, sm90 = H200) the check runs every
:class:`~tripath.portability.compile_scenarios.Scenario` under ``override_platform(target)`` and
``capture_launches()``: the public ops validate, pick that GPU's launch configuration (tiles, warps,
stages, ``waves_per_eu``, ``matrix_instr_nonkdim``) and record their launches instead of running them.
Each record becomes a :class:`~tripath.portability.compile_inspect.CompileJob` with the signature, constexprs and
alignment attributes the Triton JIT would derive from those arguments; identical jobs (same kernel,
signature, constexprs, attributes, options, target) are compiled once. Every compiled kernel is then
judged; it fails when

- it does not compile for the target, or a launch option would be rejected there;
- it spills to memory (AMD: VGPR spills or scratch; NVIDIA: local memory). AMD SGPR spills that stay in
  VGPR lanes (``v_writelane``, no memory traffic) are shown in the table and fail only with
  ``--strict-sgpr``;
- its LDS / shared memory exceeds the target's per-workgroup limit;
- it has a matrix stage (``tl.dot``) that is not on the matrix units (a dot lowered to FMA, or no
  MFMA / wgmma / mma instruction), or its ``KERNEL_ROLES`` declaration disagrees with the code;
- it is not declared in ``KERNEL_ROLES``;

unless ``DELIBERATE`` documents the finding. The launch configurations are chosen on one Triton
(``CONFIGURED_ON_TRITON``); compiled by another, a small spill (``OTHER_TRITON_SPILLS``, or a documented
``OTHER_TRITON_DELIBERATE`` entry) is reported rather than failed. The exit status is 1 when anything fails.
Compiling needs Triton's real front end, so under ``TRITON_INTERPRET=1`` the compilations run in child
processes without it (``--jobs N`` also spreads them over N children).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Iterable, Sequence

from tripath.portability.compile_inspect import (CompileJob, CompileResult, TargetSpec, compile_job, encode_value,
                                           job_from_json)
from tripath.portability.compile_scenarios import Scenario, all_scenarios
from tripath.portability.check_report import CheckReport, ScenarioError, Target, format_report
from tripath.portability.kernel_roles import (CONFIGURED_ON_TRITON, DELIBERATE, KERNEL_ROLES, OTHER_TRITON_DELIBERATE,
                                              OTHER_TRITON_SPILLS)
from tripath.triton_internals import (LaunchRecord, UnsupportedTriton, capture_launches, child_environment,
                                      current_adapter, interpreting)
from tripath.platform import H200, MI300X, MI355X, override_platform

logger = logging.getLogger(__name__)


TARGETS: dict[str, Target] = {
    "gfx942": Target("gfx942", "MI300X/MI325X", MI300X, TargetSpec("hip", "gfx942", 64), 64 * 1024),
    "gfx950": Target("gfx950", "MI355X", MI355X, TargetSpec("hip", "gfx950", 64), 160 * 1024),
    "sm90": Target("sm90", "H200", H200, TargetSpec("cuda", 90, 32), 227 * 1024),
}


# --- launches -> compile jobs --------------------------------------------------------------------------

def _raw_function(kernel):
    return kernel.fn if hasattr(kernel, "fn") else kernel


def _is_constexpr(param: inspect.Parameter) -> bool:
    ann = param.annotation
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
    return "constexpr" in text


def _backend_info(gpu: TargetSpec):
    """The Triton backend class of a target and the launch options it accepts."""
    return current_adapter().compiler_backend((gpu.backend, gpu.arch, gpu.warp_size))


def job_from_record(record: LaunchRecord, target: Target, scenario: str) -> CompileJob:
    """The compilation the Triton JIT would make for ``record`` on ``target``: the same specialisation
    (pointer dtypes, ``i32``/``i64``, 16-divisibility, ints equal to 1 and ``None`` folded to constants)."""
    adapter = current_adapter()
    fn = _raw_function(record.kernel)
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params]
    backend_cls, accepted = _backend_info(target.gpu)
    bound = dict(zip(names, record.args))
    options: dict = {}
    for key, value in record.kwargs.items():
        if key in names:
            bound[key] = value
        else:
            options[key] = value
    signature, constexprs, attrs = [], [], []
    launch_error = None
    for index, param in enumerate(params):
        if param.name in bound:
            value = bound[param.name]
        elif param.default is not inspect.Parameter.empty:
            value = param.default
        else:
            launch_error = f"argument {param.name} is missing from the launch"
            break
        if _is_constexpr(param):
            signature.append((param.name, "constexpr"))
            constexprs.append((param.name, encode_value(value)))
            continue
        ty, spec = adapter.specialize_for(backend_cls, value)
        signature.append((param.name, ty))
        if ty == "constexpr":
            constexprs.append((param.name, encode_value(value)))
        elif isinstance(spec, str):
            attrs.append((index, [list(a) for a in backend_cls.parse_attr(spec)]))
    rejected = sorted(set(options) - accepted)
    if rejected and launch_error is None:
        launch_error = (f"launch option(s) {', '.join(rejected)} not accepted by the {target.gpu.backend} "
                        "backend (the JIT would raise KeyError)")
    return CompileJob(
        kernel=f"{fn.__module__}:{fn.__name__}", kernel_file=inspect.getsourcefile(fn) or "",
        target=target.name, gpu=target.gpu, signature=signature, constexprs=constexprs, attrs=attrs,
        options=sorted((k, v) for k, v in options.items() if k in accepted), launch_error=launch_error,
        scenarios=[scenario])


def collect_jobs(scenarios: Sequence[Scenario], targets: Sequence[Target]
                 ) -> tuple[list[CompileJob], list[ScenarioError]]:
    """Run every scenario for every target and deduplicate the launches they record."""
    jobs: dict[tuple, CompileJob] = {}
    errors: list[ScenarioError] = []
    for target in targets:
        for scenario in scenarios:
            if scenario.targets is not None and target.name not in scenario.targets:
                continue
            try:
                with override_platform(target.platform), capture_launches() as records:
                    scenario.build(target.platform)
                if not records:
                    raise RuntimeError("the scenario made no kernel launch")
                new = [job_from_record(r, target, scenario.name) for r in records]
            except UnsupportedTriton:  # not the scenario's failure: nothing compiles under this Triton
                raise
            except Exception as exc:  # reported as a failure of the scenario on this target
                errors.append(ScenarioError(scenario.name, target.name, f"{type(exc).__name__}: {exc}"))
                continue
            for job in new:
                if job.key in jobs:
                    jobs[job.key].scenarios.append(scenario.name)
                else:
                    jobs[job.key] = job
    return list(jobs.values()), errors


# --- compiling (here or in child processes) -------------------------------------------------------------

def compile_jobs(jobs: Sequence[CompileJob], workers: int = 1, verbose: bool = False) -> list[CompileResult]:
    """Compile ``jobs``; in this process when possible, else (interpreter on, or ``workers > 1``) in
    ``workers`` child processes that run without ``TRITON_INTERPRET``."""
    if workers <= 1 and not interpreting():
        results = []
        for i, job in enumerate(jobs):
            results.append(compile_job(job))
            if verbose:
                logger.info("[%d/%d] %s %s %.1fs", i + 1, len(jobs), job.name, job.target, results[-1].seconds)
        return results
    workers = max(1, min(workers, len(jobs)))
    chunks = [list(range(i, len(jobs), workers)) for i in range(workers)]
    env = child_environment(interpret=False)
    results: list[CompileResult | None] = [None] * len(jobs)
    with tempfile.TemporaryDirectory(prefix="tripath-check-compile-") as tmp:
        procs = []
        for w, chunk in enumerate(chunks):
            src, dst, log = (os.path.join(tmp, f"{w}.{ext}") for ext in ("in.json", "out.json", "log"))
            with open(src, "w") as f:
                json.dump([asdict(jobs[i]) for i in chunk], f)
            cmd = [sys.executable, "-m", "tripath.portability.check_compile", "--worker", src, dst]
            cmd += ["--verbose"] if verbose else []
            log_file = open(log, "w")  # the child's stdout (and stderr unless verbose): kept for crash reports
            proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=None if verbose else log_file)
            procs.append((chunk, dst, log, log_file, proc))
        for chunk, dst, log, log_file, proc in procs:
            rc = proc.wait()
            log_file.close()
            if rc == 0 and os.path.exists(dst):
                with open(dst) as f:
                    for i, data in zip(chunk, json.load(f)):
                        results[i] = _result_from_json(data)
                continue
            tail = open(log).read()[-2000:] if os.path.exists(log) else ""
            for i in chunk:
                r = CompileResult(jobs[i].name, jobs[i].target, "", list(jobs[i].scenarios))
                r.error = f"compile worker exited with status {rc}\n{tail}"
                results[i] = r
    return [r for r in results if r is not None]


def _result_from_json(data: dict) -> CompileResult:
    data = dict(data)
    for key in ("failures", "deliberate"):
        data[key] = [tuple(item) for item in data[key]]
    return CompileResult(**data)


def _worker(src: str, dst: str, verbose: bool) -> int:
    with open(src) as f:
        jobs = [job_from_json(d) for d in json.load(f)]
    results = compile_jobs(jobs, 1, verbose)
    with open(dst, "w") as f:
        json.dump([r.to_json() for r in results], f)
    return 0


# --- judging -------------------------------------------------------------------------------------------

def evaluate(result: CompileResult, target: Target, strict_sgpr: bool = False,
             triton_version: tuple[int, int] | None = None) -> CompileResult:
    """Fill ``result.failures`` (and move findings that ``DELIBERATE`` documents, and spills accepted under
    another Triton (:func:`other_triton_spill_reason`), to ``result.deliberate``). ``strict_sgpr``: also fail
    on AMD SGPR spills that stay in VGPR lanes, and accept no spill under another Triton.
    ``triton_version``: the Triton that compiled ``result`` (default: the installed one)."""
    version = triton_version or current_adapter().version
    found: list[tuple[str, str]] = []
    role = KERNEL_ROLES.get(result.kernel)
    if result.error:
        found.append(("compile", result.error.splitlines()[0][:300]))
    else:
        if role is None:
            found.append(("undeclared", "kernel missing from KERNEL_ROLES (does it have a matrix stage?)"))
        # AMD spills SGPRs into VGPR lanes first (v_writelane, no memory traffic); only VGPR spills and
        # scratch reach memory. SGPR lane spills are shown in the table and fail only with strict_sgpr.
        spilled = any(x for x in (result.vgpr_spills, result.scratch_bytes, result.spill_store_bytes))
        if spilled or (strict_sgpr and result.sgpr_spills):
            if target.gpu.backend == "hip":
                found.append(("spill", f"{result.vgpr_spills} VGPR + {result.sgpr_spills} SGPR spills, "
                                       f"{result.scratch_bytes} B scratch"))
            else:
                found.append(("spill", f"{result.scratch_bytes} B local memory, "
                                       f"{result.spill_store_bytes} B spill stores"))
        for note in result.serialised_wgmma:
            found.append(("wgmma", f"ptxas serialised the asynchronous wgmma: {note}"))
        if result.injected_wgmma_waits:
            found.append(("wgmma", f"ptxas injected {result.injected_wgmma_waits} warpgroup.wait (C7517): code "
                                   "reads a wgmma result while the product is in flight, so they do not overlap"))
        if (result.shared_bytes or 0) > target.shared_limit:
            found.append(("shared", f"{result.shared_bytes} B shared memory > {target.shared_limit} B on "
                                    f"{target.label}"))
        if role is not None and role.matrix_stage:
            if result.dots == 0:
                found.append(("matrix", "declared with a matrix stage but has no tt.dot"))
            elif result.fma_dots:
                found.append(("matrix", f"{result.fma_dots} of {result.dots} dots lowered to FMA"))
            elif result.matrix_instrs == 0:
                found.append(("matrix", f"no {result.matrix_kind} instruction in the machine code"))
        elif role is not None and result.dots:
            found.append(("matrix", f"has {result.dots} tt.dot but KERNEL_ROLES declares no matrix stage"))
    result.failures, result.deliberate = [], []
    for kind, text in found:
        reason = DELIBERATE.get((result.kernel, target.name, kind)) or DELIBERATE.get((result.kernel, "*", kind))
        if kind == "spill" and not reason and not strict_sgpr:  # strict: every spill counts
            reason = other_triton_spill_reason(result, target, version)
        if reason and kind != "undeclared":
            result.deliberate.append((kind, f"{text} (deliberate: {reason})"))
        else:
            result.failures.append((kind, text))
    return result


def other_triton_spill_reason(result: CompileResult, target: Target, version: tuple[int, int]) -> str | None:
    """Why ``result``'s spill is accepted when compiled by Triton ``version`` (None: it is not): the
    configurations are chosen on :data:`CONFIGURED_ON_TRITON`, and under another version a spill within
    :data:`OTHER_TRITON_SPILLS`, or within an :data:`OTHER_TRITON_DELIBERATE` entry, is reported instead."""
    if version == CONFIGURED_ON_TRITON:
        return None
    spilled = (result.vgpr_spills, result.scratch_bytes, result.spill_store_bytes)
    first, bound, reason = OTHER_TRITON_DELIBERATE.get((result.kernel, target.name), (None, None, None))
    if bound is not None and version >= first and bound.holds(*spilled):
        return f"Triton {version[0]}.{version[1]}: {reason}"
    if OTHER_TRITON_SPILLS[target.gpu.backend].holds(*spilled):
        configured = ".".join(map(str, CONFIGURED_ON_TRITON))
        return (f"a small spill under Triton {version[0]}.{version[1]}; the configurations are chosen on "
                f"Triton {configured}")
    return None


def select_scenarios(subset: str = "full", only: str | None = None) -> list[Scenario]:
    rows = all_scenarios()
    if subset == "ci":
        rows = [s for s in rows if s.ci]
    elif subset != "full":
        raise ValueError(f"subset={subset!r} is not supported; supported: ci, full")
    if only:
        rows = [s for s in rows if only.lower() in s.name.lower()]
    return rows


def run_check(subset: str = "full", targets: Iterable[str] | None = None, only: str | None = None,
              workers: int = 1, verbose: bool = False, scenarios: Sequence[Scenario] | None = None,
              strict_sgpr: bool = False) -> CheckReport:
    """Compile the scenarios' kernels for ``targets`` (names of :data:`TARGETS`; default all) and judge them.
    ``scenarios`` replaces the ``subset``/``only`` selection."""
    names = list(targets or TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"targets {unknown} are not supported; supported: {', '.join(TARGETS)}")
    chosen = [TARGETS[n] for n in names]
    scenarios = list(scenarios) if scenarios is not None else select_scenarios(subset, only)
    if not scenarios:
        raise ValueError(f"no scenario matches subset={subset!r} only={only!r}")
    jobs, errors = collect_jobs(scenarios, chosen)
    results = compile_jobs(jobs, workers, verbose)
    for r in results:
        evaluate(r, TARGETS[r.target], strict_sgpr)
    order = {n: i for i, n in enumerate(names)}
    results.sort(key=lambda r: (r.kernel, order[r.target]))
    return CheckReport(chosen, results, errors)


# --- report --------------------------------------------------------------------------------------------

def main_check_compile(argv: Sequence[str] | None = None) -> int:
    """``tripath check-compile``; returns the exit status (0 all good, 1 failures)."""
    parser = argparse.ArgumentParser(
        prog="tripath check-compile",
        description="Compile every Triton kernel for gfx942 (MI300X/MI325X), gfx950 (MI355X) and sm90 (H200) "
                    "with the launch configurations the launchers choose, and check registers, spills, "
                    "shared memory and matrix-unit use.")
    parser.add_argument("--target", action="append", choices=list(TARGETS),
                        help="target to compile for (repeatable; default: all)")
    parser.add_argument("--subset", choices=("full", "ci"), default="full",
                        help="full: every scenario (default); ci: the subset the CPU test suite compiles")
    parser.add_argument("--only", help="only scenarios whose name contains this text (e.g. decode)")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--json", help="write every result as JSON to this file")
    parser.add_argument("--markdown", help="write the report to this file")
    parser.add_argument("--summary", action="store_true", help="print the per-kernel summary only")
    parser.add_argument("--strict-sgpr", action="store_true",
                        help="also fail on AMD SGPR spills that stay in VGPR lanes (no memory traffic), and accept no "
                             "spill under another Triton than the one the configurations are chosen on")
    parser.add_argument("--list", action="store_true", help="list the distinct compilations, compile nothing")
    parser.add_argument("--verbose", action="store_true", help="progress on stderr")
    parser.add_argument("--worker", nargs=2, metavar=("JOBS_JSON", "RESULTS_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker[0], args.worker[1], args.verbose)
    if args.list:
        jobs, errors = collect_jobs(select_scenarios(args.subset, args.only),
                                    [TARGETS[n] for n in (args.target or TARGETS)])
        for job in jobs:
            print(f"{job.name:28s} {job.target:7s} {len(job.scenarios):3d} scenario(s)  {job.scenarios[0]}")
        for e in errors:
            print(f"scenario error: {e.scenario} on {e.target}: {e.error}")
        print(f"{len(jobs)} distinct compilations")
        return 1 if errors else 0
    try:
        report = run_check(args.subset, args.target, args.only, args.jobs, args.verbose,
                           strict_sgpr=args.strict_sgpr)
    except ValueError as exc:
        parser.error(str(exc))
    text = format_report(report, detail=not args.summary)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ok": report.ok, "results": [r.to_json() for r in report.results],
                       "scenario_errors": [asdict(e) for e in report.scenario_errors]}, f, indent=1)
    return 0 if report.ok else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main_check_compile(sys.argv[1:]))
