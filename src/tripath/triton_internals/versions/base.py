"""What every Triton version tripath knows does the same way: the base class of the per-version adapters.

Each method is one use of a part of Triton that is not its public API (the JIT's specialisation and caches,
the compiled kernel's launcher, the compile hook, the compiler's tools, the interpreter). A version's module
(``triton_3_6`` …) subclasses this class, or the adapter of the version before it when that one's overrides
still apply, and overrides only what its version does differently. Triton is imported inside the methods,
so this module loads without it.
"""

from __future__ import annotations

from typing import Any, Callable


def _hook_set(hook) -> bool:
    """Whether a launch hook (a chain of them since Triton 3.6, empty unless something adds one) is set."""
    return hook is not None and bool(getattr(hook, "calls", True))


class TritonAdapter:
    """The calls into Triton's internals, as Triton 3.6–3.9 take them (overridden where a version differs)."""

    version: tuple[int, int] = (0, 0)

    @property
    def name(self) -> str:
        return f"Triton {self.version[0]}.{self.version[1]}"

    # --- the JIT: specialisation, compiled variants, argument binding -------------------------------------

    def specialize_impl(self) -> tuple[Callable, Any]:
        """``(impl, backend)``: ``impl(backend, value, is_const, specialize, align)`` returns the JIT's
        ``(type, specialisation)`` of a launch argument (integers: dtype, 16-divisibility, 1-ness; pointers:
        dtype, 16-byte alignment), the same for every GPU backend."""
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl

        return native_specialize_impl, BaseBackend

    def jit_function_type(self) -> type:
        """The class of ``@triton.jit`` functions compiled by the JIT (not interpreted)."""
        from triton.runtime.jit import JITFunction

        return JITFunction

    def rebuild_jit_function(self, interpreted) -> Any:
        """A ``JITFunction`` of an interpreted kernel's Python function, with its specialisation options (only
        its signature and parameters are read: nothing is compiled)."""
        options = getattr(interpreted, "kwargs", {})
        return self.jit_function_type()(interpreted.fn, **{
            k: v for k, v in options.items() if k in ("do_not_specialize", "do_not_specialize_on_alignment")})

    def variants_in_memory(self, jit_function) -> int:
        """Compiled variants in a ``JITFunction``'s in-memory caches, over every device."""
        return sum(len(caches[0]) for caches in jit_function.device_caches.values())

    def binder(self, jit_function, device: int) -> Callable:
        """The JIT's argument binder of ``jit_function`` on ``device``: ``binder(*args, **kwargs)[0]`` is the dict
        of every parameter's bound value in the kernel's order."""
        return jit_function.device_caches[device][4]

    def jit_target(self, jit_function, device: int):
        """The ``GPUTarget`` the JIT compiles ``jit_function`` for on ``device``."""
        return jit_function.device_caches[device][2]

    # --- the runtime: devices, streams, launch hooks, compiled kernels -------------------------------------

    def current_device(self) -> int:
        from triton.runtime import driver

        return driver.active.get_current_device()

    def stream_getter(self) -> Callable[[int | None], int]:
        """``get(device_index)``: the handle of the device's current stream (called per replay: a bound method,
        no wrapper)."""
        from triton.runtime import driver

        return driver.active.get_current_stream

    def launch_hooks_attached(self) -> bool:
        """Whether a Triton launch hook is set (a profiler attached): launches made outside the JIT pass none."""
        from triton import knobs

        return _hook_set(knobs.runtime.launch_enter_hook) or _hook_set(knobs.runtime.launch_exit_hook)

    def compiled_launcher(self, compiled) -> tuple[Callable, Any, Any] | None:
        """``(run, function, packed_metadata)`` of a ``CompiledKernel`` (None if it is not one), launched as
        ``run(grid_x, grid_y, grid_z, stream, function, packed_metadata, None, None, None, *bound_values)``:
        the JIT's own launch with no launch metadata and no hooks."""
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return None
        return compiled.run, compiled.function, compiled.packed_metadata

    # --- the JIT's compile hook and cache -----------------------------------------------------------------

    def jit_cache_hook(self) -> Callable | None:
        """The hook the JIT calls before it compiles a variant, as
        ``hook(key=, repr=, fn=, compile=, is_manual_warmup=, already_compiled=)``; a true answer skips the
        compilation and the launch."""
        from triton import knobs

        return knobs.runtime.jit_cache_hook

    def set_jit_cache_hook(self, hook: Callable | None) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = hook

    def compilation_from_hook(self, fn, compile: dict) -> dict:
        """What the compile hook's ``fn`` and ``compile`` arguments say about the compilation: the kernel's
        ``module`` and ``name``, ``signature``, ``constexprs``, ``attrs``, launch ``options`` and the target
        ``(backend, arch, warp_size)``."""
        import json

        target = self.jit_target(fn.jit_function, compile["device"])
        options = json.loads(compile["specialization_data"])["options"]
        return dict(module=fn.module, name=fn.name, signature=dict(compile["signature"]),
                    constexprs=dict(compile["constants"]), attrs=dict(compile["configs"][0]),
                    options={k: tuple(v) if isinstance(v, list) else v for k, v in options.items()},
                    target=(target.backend, target.arch, target.warp_size))

    def cache_dir(self) -> str:
        """The directory the JIT reads and writes compiled kernels in (``TRITON_CACHE_DIR`` or its default)."""
        from triton import knobs

        return knobs.cache.dir

    # --- compiling outside the JIT (compile workers, the portability check) --------------------------------

    def ast_source(self, kernel, signature: dict, constexprs: dict, attrs: dict):
        """The compiler's source of a ``@triton.jit`` or ``@gluon.jit`` kernel (Gluon starts at TTGIR)."""
        if kernel.is_gluon():
            from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
        else:
            from triton.compiler import ASTSource
        return ASTSource(kernel, signature, constexprs, attrs)

    def compile(self, source, target: tuple, options: dict):
        """``triton.compile`` of ``source`` for ``target = (backend, arch, warp_size)``."""
        import triton
        from triton.backends.compiler import GPUTarget

        return triton.compile(source, target=GPUTarget(*target), options=options)

    def build_launch_stub(self, compiled, backend: str) -> None:
        """Build ``compiled``'s host-side launch stub into the cache (a C compilation the JIT makes at a
        kernel's first load); needs the GPU driver's library, not a GPU."""
        if backend == "cuda":
            from triton.backends.nvidia.driver import CudaLauncher as Launcher
        else:
            from triton.backends.amd.driver import HIPLauncher as Launcher
        Launcher(compiled.src, compiled.metadata)

    def compiler_backend(self, target: tuple) -> tuple[type, set[str]]:
        """The compiler backend class of ``target = (backend, arch, warp_size)`` and the launch options it
        accepts."""
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        backend = make_backend(GPUTarget(*target))
        return type(backend), set(backend.parse_options({}).__dict__)

    def specialize_for(self, backend_cls: type, value) -> tuple[str, Any]:
        """``(type, specialisation)`` of a launch argument as ``backend_cls``'s JIT derives it (every argument
        specialised: the portability check compiles what an unmarked argument would give)."""
        from triton._C.libtriton import native_specialize_impl

        return native_specialize_impl(backend_cls, value, False, True, True)

    def ptxas(self, arch: int) -> tuple[str, list[str]]:
        """The ``ptxas`` Triton assembles for ``arch`` with, and the options it adds (for a ``-v`` rerun that
        reports the same spills)."""
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path, []

    def cuobjdump(self) -> str:
        from triton import knobs

        return knobs.nvidia.cuobjdump.path

    # --- the interpreter ----------------------------------------------------------------------------------

    def prepare_interpreter(self) -> None:
        """Make this version's interpreter (``TRITON_INTERPRET=1``) ready for tripath's kernels; called once
        before the first interpreted launch."""
