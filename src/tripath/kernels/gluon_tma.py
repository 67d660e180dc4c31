"""Hopper's TMA copies for the Gluon kernels, under the names the installed Triton gives them.

Triton 3.8 renamed ``tma.async_copy_global_to_shared(desc, coord, barrier, result, pred=True)`` to
``tma.async_load`` and ``tma.async_copy_shared_to_global(desc, coord, src)`` to ``tma.async_store``, with the
same arguments; Triton 3.9 made the old names raise. The Gluon kernels call :func:`tma_load` and
:func:`tma_store`, which are those builtins themselves (the compiled code is the same under either name).
"""

from triton.experimental.gluon.language.nvidia.hopper import tma

tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
