"""The portability check's report: its targets and results (:class:`CheckReport`), a summary table per kernel
and target (configurations, status, registers, spills, shared memory, matrix units) and the per-compilation
detail (:func:`format_report`)."""

from __future__ import annotations

from dataclasses import dataclass

from tripath.platform import Platform
from tripath.portability.compile_inspect import CompileResult, TargetSpec
from tripath.portability.kernel_roles import KERNEL_ROLES


@dataclass(frozen=True)
class Target:
    """A compile target: the platform the launchers choose for and Triton's ``GPUTarget``."""

    name: str
    label: str
    platform: Platform
    gpu: TargetSpec
    shared_limit: int  # bytes of LDS / shared memory one workgroup may use


@dataclass
class ScenarioError:
    scenario: str
    target: str
    error: str


@dataclass
class CheckReport:
    targets: list[Target]
    results: list[CompileResult]
    scenario_errors: list[ScenarioError]

    @property
    def ok(self) -> bool:
        return not self.scenario_errors and all(not r.failures for r in self.results)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in rows])


def _regs(r: CompileResult) -> str:
    if r.regs is None:
        return "-"
    return f"{r.regs}v/{r.sgprs}s" if r.sgprs is not None else str(r.regs)


def _spills(r: CompileResult) -> str:
    """Memory spills (AMD VGPR spill count, NVIDIA spill-store bytes) with scratch bytes; AMD SGPR spills
    into VGPR lanes after a ``+``."""
    if r.error:
        return "-"
    if r.vgpr_spills is not None:
        text = str(r.vgpr_spills or 0) + (f" ({r.scratch_bytes}B)" if r.scratch_bytes else "")
        return text + (f" +{r.sgpr_spills} sgpr" if r.sgpr_spills else "")
    return f"{r.spill_store_bytes or 0}B" + (f" ({r.scratch_bytes}B local)" if r.scratch_bytes else "")


def _matrix(r: CompileResult) -> str:
    if r.error:
        return "-"
    if not r.dots:
        return "no dot"
    return f"{r.matrix_kind} x{r.matrix_instrs}" + (f", {r.fma_dots} FMA dots" if r.fma_dots else "")


def summary_table(report: CheckReport) -> str:
    """One row per kernel and target: configurations compiled, worst registers (``v``GPRs incl. AGPRs /
    ``s``GPRs on AMD), how many configurations spill to memory and how many spill SGPRs into VGPR lanes,
    the largest LDS / shared memory, and in how many configurations the dots run on the matrix units."""
    rows = []
    kernels = sorted({r.kernel for r in report.results})
    for kernel in kernels:
        role = KERNEL_ROLES.get(kernel)
        for target in report.targets:
            rs = [r for r in report.results if r.kernel == kernel and r.target == target.name]
            if not rs:
                continue
            ok = [r for r in rs if not r.error]
            failed = sum(1 for r in rs if r.failures)
            status = f"FAIL {failed}/{len(rs)}" if failed else ("ok*" if any(r.deliberate for r in rs) else "ok")
            regs = max((r.regs or 0 for r in ok), default=0)
            sgprs = max((r.sgprs or 0 for r in ok), default=0)
            spilled = sum(1 for r in ok if r.vgpr_spills or r.scratch_bytes or r.spill_store_bytes)
            lanes = sum(1 for r in ok if r.sgpr_spills)
            shared = max((r.shared_bytes or 0 for r in ok), default=0)
            if role is None or not role.matrix_stage:
                matrix = "no matrix stage (deliberate)" if role else "undeclared"
            else:
                using = sum(1 for r in ok if r.matrix_instrs and not r.fma_dots)
                kinds = sorted({k for r in ok for k in r.matrix_kind.split("+")})
                matrix = f"{'+'.join(kinds)} in {using}/{len(rs)}"
            reg_text = f"{regs}v/{sgprs}s" if target.gpu.backend == "hip" else str(regs)
            rows.append([kernel, target.name, str(len(rs)), status, reg_text, str(spilled),
                         str(lanes) if target.gpu.backend == "hip" else "-", f"{shared / 1024:.1f} KiB", matrix])
    header = ["kernel", "target", "configs", "status", "max regs", "spilling", "SGPR lane spills",
              "max LDS/smem", "matrix units"]
    return _table(header, rows)


def detail_table(report: CheckReport) -> str:
    """One row per distinct compilation."""
    rows = []
    for r in report.results:
        scen = r.scenarios[0] + (f" (+{len(r.scenarios) - 1})" if len(r.scenarios) > 1 else "")
        notes = "; ".join(f"{k}: {t}" for k, t in r.failures + r.deliberate)
        occ = f" occ{r.occupancy}" if r.occupancy is not None else ""
        rows.append([r.kernel, r.target, r.config, scen, r.status, _regs(r) + occ, _spills(r),
                     f"{(r.shared_bytes or 0) / 1024:.1f} KiB" if not r.error else "-", _matrix(r), notes])
    header = ["kernel", "target", "config", "scenario", "status", "regs", "spills", "LDS/smem", "matrix",
              "notes"]
    return _table(header, rows)


def format_report(report: CheckReport, detail: bool = True) -> str:
    parts = ["Targets: " + ", ".join(f"{t.name} ({t.label})" for t in report.targets), "", summary_table(report)]
    if detail:
        parts += ["", detail_table(report)]
    if report.scenario_errors:
        parts += ["", "Scenario errors:"] + [f"- {e.scenario} on {e.target}: {e.error}"
                                             for e in report.scenario_errors]
    failed = [r for r in report.results if r.failures]
    if failed:
        parts += ["", "Failures:"]
        for r in failed:
            for kind, text in r.failures:
                parts.append(f"- {r.kernel} on {r.target} [{r.config}] ({r.scenarios[0]}): {kind}: {text}")
    n = len(report.results)
    parts += ["", f"{n} compilations, {len(failed)} failed, {len(report.scenario_errors)} scenario errors: "
                  + ("OK" if report.ok else "FAILED")]
    return "\n".join(parts)


# --- command line --------------------------------------------------------------------------------------
