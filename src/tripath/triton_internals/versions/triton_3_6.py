"""Triton 3.6 (the Triton of torch 2.11): the base behaviour, and a fix to its interpreter for current numpy."""

from __future__ import annotations

from tripath.triton_internals.versions.base import TritonAdapter


class Triton36(TritonAdapter):
    version = (3, 6)

    def prepare_interpreter(self) -> None:
        """Triton 3.6's interpreter turns a one-element block into an index with ``int(array)``, which numpy
        deprecates for arrays of one or more dimensions since 1.25 and refuses since 2.3 ("only 0-dimensional
        arrays can be converted to Python scalars"); Triton 3.7 squeezes the array first. This does the same,
        by wrapping the interpreter's patch of ``tl.tensor`` (once)."""
        from triton.runtime import interpreter

        patch_tensor = interpreter._patch_lang_tensor
        if getattr(patch_tensor, "tripath_squeezes", False):
            return

        def patch_tensor_squeezing(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        patch_tensor_squeezing.tripath_squeezes = True
        interpreter._patch_lang_tensor = patch_tensor_squeezing
