"""Compile one recorded launch for one target and read what the machine code says about it.

A :class:`CompileJob` is plain data (kernel ``module:name``, signature, constexprs, attributes, launch
options, target), so it can be compiled in this process or in a child process without the Triton
interpreter. :func:`compile_job` compiles it with ``triton.compile(ASTSource(...), target=GPUTarget(...))``
and reports:

- AMD (``amdgcn``): VGPRs / AGPRs / SGPRs, VGPR and SGPR spill counts and scratch bytes from the code
  object metadata, occupancy (waves per SIMD), LDS bytes, and the number of ``v_mfma`` instructions.
- NVIDIA (``ptx`` + ``cubin``): registers, local-memory bytes and shared memory from
  ``cuobjdump -res-usage`` (spill store/load bytes from ``ptxas -v`` when local memory is used), and the
  number of ``wgmma.mma_async`` / ``mma.sync`` instructions.
- Both: how many ``tt.dot`` the kernel has (TTIR) and how many of them the compiler lowered to FMA
  instead of a matrix-unit layout (TTGIR result encoding ``#blocked`` rather than ``amd_mfma`` /
  ``nvidia_mma``).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from tripath.triton_internals import current_adapter


@dataclass(frozen=True)
class TargetSpec:
    """A Triton ``GPUTarget`` by value: ``backend`` ``"hip"``/``"cuda"``, ``arch`` (gfx name or capability)."""

    backend: str
    arch: int | str
    warp_size: int


@dataclass
class CompileJob:
    """Everything ``triton.compile`` needs, as JSON-able data. ``key`` identifies a distinct compilation."""

    kernel: str  # "module:function"
    kernel_file: str
    target: str  # name in check_compile.TARGETS
    gpu: TargetSpec
    signature: list[tuple[str, str]]
    constexprs: list[tuple[str, Any]]
    attrs: list[tuple[int, list]]
    options: list[tuple[str, Any]]
    launch_error: str | None = None
    scenarios: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.kernel.split(":")[1]

    @property
    def key(self) -> tuple:
        return (self.kernel, self.target, repr(self.signature), repr(self.constexprs), repr(self.attrs),
                repr(self.options), self.launch_error)


@dataclass
class CompileResult:
    """What one compilation produced (``None`` where a number does not apply to the target)."""

    kernel: str
    target: str
    config: str
    scenarios: list[str]
    error: str | None = None
    seconds: float = 0.0
    regs: int | None = None  # VGPRs (arch + acc) on AMD, registers per thread on NVIDIA
    agprs: int | None = None
    sgprs: int | None = None
    vgpr_spills: int | None = None
    sgpr_spills: int | None = None
    scratch_bytes: int | None = None  # AMD private segment / NVIDIA local memory, per thread
    spill_store_bytes: int | None = None
    shared_bytes: int | None = None  # LDS on AMD, shared memory on NVIDIA (dynamic + static)
    occupancy: int | None = None  # AMD waves per SIMD
    dots: int = 0  # tt.dot in the kernel (TTIR)
    fma_dots: int = 0  # of those, lowered without the matrix units (TTGIR)
    matrix_instrs: int = 0  # v_mfma / wgmma / mma.sync instructions in the machine code
    matrix_kind: str = ""
    warnings: list[str] = field(default_factory=list)
    serialised_wgmma: list[str] = field(default_factory=list)  # ptxas "Potential Performance Loss" notes
    injected_wgmma_waits: int = 0  # ptxas C7517 notes: warpgroup.wait it added before a read of a wgmma result
    failures: list[tuple[str, str]] = field(default_factory=list)
    deliberate: list[tuple[str, str]] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.failures:
            return "FAIL"
        return "ok*" if self.deliberate else "ok"

    def to_json(self) -> dict:
        return asdict(self)


# --- constexpr values as JSON --------------------------------------------------------------------------

def encode_value(value: Any) -> Any:
    """constexpr values: numbers, bools, None, strings pass through; ``tl.dtype`` becomes a tagged name."""
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"constexpr value {value!r} of type {type(value).__name__} cannot be recorded")


def decode_value(value: Any) -> Any:
    import triton.language as tl

    if isinstance(value, dict) and "tl_dtype" in value:
        return tl.dtype(value["tl_dtype"])
    return value


def job_from_json(data: dict) -> CompileJob:
    data = dict(data)
    data["gpu"] = TargetSpec(**data["gpu"])
    for name in ("signature", "constexprs", "attrs", "options"):
        data[name] = [tuple(item) for item in data[name]]
    return CompileJob(**data)


# --- compiling -----------------------------------------------------------------------------------------

def load_kernel(ref: str, path: str):
    """The ``@triton.jit`` function ``module:name`` (importing ``path``'s folder if the module is not found)."""
    module_name, name = ref.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        sys.path.insert(0, os.path.dirname(path))
        module = importlib.import_module(module_name)
    kernel = getattr(module, name)
    if not isinstance(kernel, current_adapter().jit_function_type()):
        raise RuntimeError(f"{ref} is a {type(kernel).__name__}, not a JITFunction: Triton was imported with "
                           "TRITON_INTERPRET=1; compile in a process without it")
    return kernel


def _config_text(job: CompileJob) -> str:
    return describe_config(job.signature, dict(job.constexprs), dict(job.options))


def describe_config(signature: list[tuple[str, str]], constexprs: dict, options: dict) -> str:
    """Short label: data dtypes, tile constexprs, launch options (``w`` warps, ``s`` stages, ``wpe``
    waves_per_eu, ``nk`` matrix_instr_nonkdim)."""
    dtypes: list[str] = []
    for _, ty in signature:
        if ty.startswith("*") and ty[1:] not in ("i32", "i64", "fp32", "i8", "u8") and ty[1:] not in dtypes:
            dtypes.append(ty[1:])
    tiles = [f"{k.replace('BLOCK_', '')}={v}" for k, v in constexprs.items()
             if k.startswith("BLOCK_") or k == "SPLIT"]
    flags = [k.lower().replace("has_", "") for k, v in constexprs.items()
             if v is True and k.startswith(("HAS_", "SHUFFLED", "CAUSAL", "RETURN_LSE", "QUANT", "DEQUANT", "KV_FP8"))]
    opts = [f"w{options.get('num_warps', 4)}"]
    for key, short in (("num_stages", "s"), ("waves_per_eu", "wpe"), ("matrix_instr_nonkdim", "nk"),
                       ("kpack", "kpack")):
        if key in options:
            opts.append(f"{short}{options[key]}")
    parts = ["/".join(dtypes) or "-", " ".join(tiles)]
    if flags:
        parts.append(",".join(flags))
    parts.append(" ".join(opts))
    return "; ".join(p for p in parts if p)


def compile_job(job: CompileJob) -> CompileResult:
    """Compile ``job`` and inspect the result (a compile error is recorded, not raised)."""
    result = CompileResult(job.name, job.target, _config_text(job), list(job.scenarios))
    if job.launch_error:
        result.error = job.launch_error
        return result
    start = time.perf_counter()
    try:
        adapter = current_adapter()
        kernel = load_kernel(job.kernel, job.kernel_file)
        # a Gluon kernel starts at TTGIR (layouts given), not TTIR
        source = adapter.ast_source(kernel, dict(job.signature),
                                    {name: decode_value(v) for name, v in job.constexprs},
                                    {(index,): [list(a) for a in attr] for index, attr in job.attrs})
        # Triton prints the whole PTX when ptxas fails; keep it out of the report (the error says enough).
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("always")
            compiled = adapter.compile(source, (job.gpu.backend, job.gpu.arch, job.gpu.warp_size),
                                       dict(job.options))
        result.warnings = sorted({str(w.message).splitlines()[0] for w in caught})
    except Exception as exc:  # a failed compile is a finding, reported per kernel and target
        result.error = _error_text(exc)
        result.seconds = time.perf_counter() - start
        return result
    asm = compiled.asm
    result.shared_bytes = int(compiled.metadata.shared)
    result.dots = count_gluon_dots(asm["ttgir"]) if kernel.is_gluon() else count_dots(asm.get("ttir", ""))
    result.fma_dots = count_fma_dots(asm.get("ttgir", ""))
    if job.gpu.backend == "hip":
        _fill_amd(result, asm["amdgcn"])
    else:
        _fill_nvidia(result, asm["ptx"], asm["cubin"], job.gpu.arch)
    result.seconds = time.perf_counter() - start
    return result


def _error_text(exc: BaseException) -> str:
    """First line: the innermost cause (Triton's CompilationError chains nested failures as ``__cause__``
    and keeps the message in ``error_message``) and the source line it points at; then the outer message."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 10:
        chain.append(chain[-1].__cause__)
    located = [e for e in chain if getattr(e, "error_message", None)]
    if located:
        inner = located[-1]
        head = inner.error_message.strip().splitlines()[0][:200]
        lineno = getattr(inner.node, "lineno", None)
        if inner.src and lineno:
            head += f" [at: {inner.src.splitlines()[lineno - 1].strip()}]"
    else:
        root = chain[-1]
        head = f"{type(root).__name__}: " + next((l for l in str(root).splitlines() if l.strip()), "")[:400]
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 12:
        lines = lines[:2] + ["..."] + lines[-8:]
    return "\n".join([head] + lines)


# --- reading the code ----------------------------------------------------------------------------------

_DOT_OP = re.compile(r"=\s*(tt\.dot(?:_scaled)?|ttng\.warp_group_dot|ttng\.tc_gen5_mma\w*)\b(.*)$", re.M)
_MATRIX_LAYOUTS = ("amd_mfma", "amd_wmma", "nvidia_mma")


def count_dots(ttir: str) -> int:
    """``tt.dot`` operations of the kernel before layout assignment."""
    return len(re.findall(r"=\s*tt\.dot(?:_scaled)?\b", ttir))


def count_gluon_dots(ttgir: str) -> int:
    """Matrix products a Gluon kernel spells out (``warpgroup_mma``, ``mma_v2``, ``dot_fma``) in its TTGIR."""
    return len(re.findall(r"=\s*(?:ttng\.warp_group_dot|ttg\.mma_v2|tt\.dot)\b", ttgir))


def count_fma_dots(ttgir: str) -> int:
    """Dots whose result layout is not a matrix-unit layout (the compiler fell back to FMA)."""
    aliases = dict(re.findall(r"^(#[\w.]+)\s*=\s*(#.*)$", ttgir, re.M))
    fma = 0
    for op, rest in _DOT_OP.findall(ttgir):
        if op.startswith("ttng."):
            continue  # Hopper/Blackwell async MMA ops are matrix-unit ops by construction
        enc = re.search(r"->\s*tensor<[^,>]*,\s*(#[\w.]+)", rest)
        layout = aliases.get(enc.group(1), enc.group(1)) if enc else ""
        if not any(name in layout for name in _MATRIX_LAYOUTS):
            fma += 1
    return fma


def amd_code_stats(amdgcn: str) -> dict[str, int | None]:
    """Register, spill, LDS, occupancy and MFMA counts of an ``amdgcn`` listing."""
    def meta(key: str) -> int | None:
        found = re.search(rf"^\s*\.{key}:\s*(\d+)", amdgcn, re.M)
        return int(found.group(1)) if found else None

    occupancy = re.search(r";\s*Occupancy:\s*(\d+)", amdgcn)
    return {
        "vgprs": meta("vgpr_count"), "agprs": meta("agpr_count"), "sgprs": meta("sgpr_count"),
        "vgpr_spills": meta("vgpr_spill_count"), "sgpr_spills": meta("sgpr_spill_count"),
        "scratch": meta("private_segment_fixed_size"), "lds": meta("group_segment_fixed_size"),
        "occupancy": int(occupancy.group(1)) if occupancy else None,
        "mfma": len(re.findall(r"^\s*v_s?mfma\w*", amdgcn, re.M)),
    }


def _fill_amd(result: CompileResult, amdgcn: str) -> None:
    stats = amd_code_stats(amdgcn)
    result.regs, result.agprs, result.sgprs = stats["vgprs"], stats["agprs"], stats["sgprs"]
    result.vgpr_spills, result.sgpr_spills = stats["vgpr_spills"], stats["sgpr_spills"]
    result.scratch_bytes, result.occupancy = stats["scratch"], stats["occupancy"]
    result.shared_bytes = max(result.shared_bytes or 0, stats["lds"] or 0)
    result.matrix_instrs, result.matrix_kind = stats["mfma"], "MFMA"


def ptx_matrix_instrs(ptx: str) -> tuple[int, str]:
    """Count of Hopper ``wgmma.mma_async`` and Ampere-style ``mma.sync`` instructions, and which."""
    wgmma = len(re.findall(r"\bwgmma\.mma_async\b", ptx))
    mma = len(re.findall(r"\bmma\.sync\.", ptx))
    kind = "+".join(name for name, n in (("wgmma", wgmma), ("mma", mma)) if n) or "wgmma/mma"
    return wgmma + mma, kind


def cuobjdump_usage(text: str) -> dict[str, int]:
    """``REG``/``STACK``/``SHARED``/``LOCAL`` of the kernel function in ``cuobjdump -res-usage`` output."""
    function = text.split("Function", 1)[-1]
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", function)}


def ptxas_spills(text: str) -> int | None:
    found = re.search(r"(\d+) bytes spill stores", text)
    return int(found.group(1)) if found else None


def ptxas_wgmma_serialised(text: str) -> list[str]:
    """ptxas's notes (``-v``) that it serialised asynchronous ``wgmma``: a non-wgmma instruction touches an
    accumulator in flight (C7514/C7515), e.g. one carried across a loop's back edge, and every ``wgmma`` of
    the kernel then waits for the one before it."""
    return sorted({re.sub(r"\s+in the function.*", "", m.group(1)).strip()
                   for m in re.finditer(r"Potential Performance Loss: (wgmma[^\n]*)", text)})


def ptxas_injected_waits(text: str) -> int:
    """How many ``warpgroup.wait`` ptxas injected (``-v`` note C7517) because an instruction reads registers
    that an asynchronous ``wgmma`` still in flight defines: the code after that point no longer overlaps
    the product (the source asked for overlap that the machine code does not have)."""
    return len(re.findall(r"\(C7517\)", text))


def _fill_nvidia(result: CompileResult, ptx: str, cubin: bytes, arch: int) -> None:
    adapter = current_adapter()
    result.matrix_instrs, result.matrix_kind = ptx_matrix_instrs(ptx)
    with tempfile.TemporaryDirectory() as tmp:
        cubin_path = os.path.join(tmp, "kernel.cubin")
        with open(cubin_path, "wb") as f:
            f.write(cubin)
        dump = subprocess.run([adapter.cuobjdump(), "-res-usage", cubin_path], capture_output=True,
                              text=True, check=True).stdout
        usage = cuobjdump_usage(dump)
        result.regs = usage.get("REG")
        result.scratch_bytes = usage.get("LOCAL", 0) + usage.get("STACK", 0)
        result.shared_bytes = (result.shared_bytes or 0) + usage.get("SHARED", 0)
        result.spill_store_bytes = 0
        if result.scratch_bytes or "wgmma.mma_async" in ptx:
            ptx_path = os.path.join(tmp, "kernel.ptx")
            with open(ptx_path, "w") as f:
                f.write(ptx)
            suffix = "a" if int(arch) >= 90 else ""
            ptxas, options = adapter.ptxas(int(arch))
            log = subprocess.run([ptxas, "-v", *options, f"--gpu-name=sm_{arch}{suffix}", ptx_path, "-o",
                                  os.path.join(tmp, "kernel.o")], capture_output=True, text=True)
            result.spill_store_bytes = ptxas_spills(log.stderr + log.stdout) or 0
            result.serialised_wgmma = ptxas_wgmma_serialised(log.stderr + log.stdout)
            result.injected_wgmma_waits = ptxas_injected_waits(log.stderr + log.stdout)
