"""Triton 3.9 (torch 2.15): the internals tripath uses are as in 3.8. (sm_90 code is assembled by the CUDA 13
``ptxas``, which Triton's ``get_ptxas`` names; the old Gluon TMA names raise.)"""

from __future__ import annotations

from tripath.triton_internals.versions.triton_3_8 import Triton38


class Triton39(Triton38):
    version = (3, 9)
