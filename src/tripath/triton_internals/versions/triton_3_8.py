"""Triton 3.8 (torch 2.14): the internals tripath uses are as in 3.7. (Gluon's Hopper TMA copies were renamed
``async_load`` / ``async_store``: the kernels take them from :mod:`tripath.kernels.gluon_tma`.)"""

from __future__ import annotations

from tripath.triton_internals.versions.triton_3_7 import Triton37


class Triton38(Triton37):
    version = (3, 8)
