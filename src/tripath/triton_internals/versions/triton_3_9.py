"""Triton 3.9 (torch 2.15): the internals tripath uses are as in 3.8, and its interpreter needs boolean masks.
(sm_90 code is assembled by the CUDA 13 ``ptxas``, which Triton's ``get_ptxas`` names; the old Gluon TMA names
raise: the kernels take the new ones from :mod:`tripath.kernels.gluon_tma`.)"""

from __future__ import annotations

from tripath.triton_internals.versions.triton_3_8 import Triton38


class Triton39(Triton38):
    version = (3, 9)

    def prepare_interpreter(self) -> None:
        """Triton 3.9's interpreter hands masks to compiled loads and stores that take boolean arrays only
        ("mask has unsupported dtype"). A mask built from a scalar comparison broadcast to a block, such as
        ``row_ok & (part == 0)``, reaches them as an integer array: the interpreter's comparison results keep
        their operands' dtype, and the broadcast follows it. Triton 3.6-3.8 took such masks as true where
        non-zero; this converts them to boolean before the load or store (once)."""
        import numpy as np
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

        masked_load, masked_store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
        if getattr(masked_store, "tripath_bool_masks", False):
            return

        def boolean(mask):
            return mask if mask.data.dtype == np.bool_ else TensorHandle(mask.data.astype(np.bool_), mask.dtype)

        def load_with_boolean_mask(builder, ptrs, mask, other, cache_policy, is_volatile):
            return masked_load(builder, ptrs, boolean(mask), other, cache_policy, is_volatile)

        def store_with_boolean_mask(builder, ptrs, value, mask, cache_policy):
            return masked_store(builder, ptrs, value, boolean(mask), cache_policy)

        store_with_boolean_mask.tripath_bool_masks = True
        InterpreterBuilder.create_masked_load = load_with_boolean_mask
        InterpreterBuilder.create_masked_store = store_with_boolean_mask
