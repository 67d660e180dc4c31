"""The package that touches Triton's internals: one adapter per known Triton version, an unknown version refused
by name, the declared Triton range equal to the known versions, imports that load neither PyTorch nor Triton,
and the installed version's adapter against what its Triton does (interpreter, launch hooks, compiled
kernels)."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from tripath.triton_internals import UnsupportedTriton, current_adapter, interpreting, versions
from tripath.triton_internals.versions.triton_3_6 import Triton36
from tripath.triton_internals.versions.triton_3_9 import Triton39

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_triton_has_its_own_adapter():
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", triton.__version__).groups())
    assert current_adapter().version == (major, minor), (
        f"no adapter for the installed Triton {triton.__version__}: add one to tripath.triton_internals.versions")


@pytest.mark.parametrize("version", ["3.10.0", "3.5.1", "4.0.0", "2.3.1", "nightly"])
def test_an_unknown_triton_is_refused_by_name(version):
    with pytest.raises(UnsupportedTriton, match=re.escape(f"does not know Triton {version}")) as caught:
        versions.adapter_for(version)
    assert "3.6, 3.7, 3.8, 3.9" in str(caught.value)
    assert "pip install 'triton>=3.6,<3.10'" in str(caught.value)


@pytest.mark.parametrize("version, expected", [("3.6.0", Triton36), ("3.9.0+git4a5b6c7", Triton39),
                                               ("3.9.1", Triton39)])
def test_known_versions_with_any_patch_level_find_their_adapter(version, expected):
    assert type(versions.adapter_for(version)) is expected


def test_every_adapter_declares_the_version_it_is_registered_under():
    assert sorted(versions.ADAPTERS) == [(3, 6), (3, 7), (3, 8), (3, 9)]
    for key, cls in versions.ADAPTERS.items():
        assert cls.version == key and cls().name == f"Triton {key[0]}.{key[1]}"


def test_the_declared_triton_range_is_the_known_versions():
    found = re.search(r'"triton>=(\d+)\.(\d+),<(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    first, past = (int(found[1]), int(found[2])), (int(found[3]), int(found[4]))
    assert first == min(versions.ADAPTERS)
    assert past == (max(versions.ADAPTERS)[0], max(versions.ADAPTERS)[1] + 1)


def test_importing_the_package_and_the_kernels_loads_no_torch():
    code = ("import sys, tripath.triton_internals, tripath.triton_internals.specialize, tripath.kernels.rms_norm; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # the compile workers import the kernels without PyTorch


def test_importing_the_package_alone_loads_no_triton():
    code = "import sys, tripath.triton_internals; print('triton' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False False"


def test_an_unknown_public_name_is_an_attribute_error():
    import tripath.triton_internals as internals

    with pytest.raises(AttributeError, match="no_such_name"):
        internals.no_such_name  # noqa: B018


@triton.jit
def _count_to_kernel(n_ptr, out_ptr):
    n = tl.load(n_ptr)
    count = 0
    for _ in range(n):  # the interpreter takes the loaded one-element block as a Python index
        count += 1
    tl.store(out_ptr, count)


@pytest.mark.skipif(not interpreting(), reason="the interpreter runs on a machine without a GPU")
def test_the_interpreter_takes_a_loaded_block_as_an_index():
    from tripath.triton_internals import interpreter

    interpreter.ready()
    n = torch.tensor([5], dtype=torch.int32)
    out = torch.zeros(1, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # numpy 1.25-2.2: deprecated; 2.3 and newer: an error
        _count_to_kernel[(1,)](n, out)
    assert out.item() == 5


@triton.jit
def _copy_where_kernel(out_ptr, in_ptr, n, PARTS: tl.constexpr):
    part = tl.program_id(0) % PARTS
    offsets = tl.arange(0, 8)
    mask = (offsets < n) & (part == 0)  # a block and a scalar comparison broadcast to it
    tl.store(out_ptr + offsets, tl.load(in_ptr + offsets, mask=mask, other=-1.0), mask=mask)


@pytest.mark.skipif(not interpreting(), reason="the interpreter runs on a machine without a GPU")
def test_the_interpreter_takes_masks_made_from_scalar_comparisons():
    from tripath.triton_internals import interpreter

    interpreter.ready()
    source = torch.arange(1.0, 9.0)
    out = torch.full((8,), float("nan"))
    _copy_where_kernel[(2,)](out, source, 5, PARTS=2)  # program 1 masks everything off
    assert torch.equal(out[:5], source[:5]) and out[5:].isnan().all()


def test_launch_hooks_are_seen_while_set():
    from triton import knobs

    adapter = current_adapter()
    assert not adapter.launch_hooks_attached()
    hook = lambda *args, **kwargs: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert adapter.launch_hooks_attached()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not adapter.launch_hooks_attached()


def test_only_compiled_kernels_have_a_launcher():
    adapter = current_adapter()
    assert adapter.compiled_launcher(None) is None
    assert adapter.compiled_launcher(object()) is None


def test_ptxas_reruns_take_the_options_triton_assembles_with():
    path, options = current_adapter().ptxas(90)
    assert Path(path).name.startswith("ptxas")
    assert ("--regAllocOptLevel=2" in options) == (current_adapter().version >= (3, 7))


def test_child_environments_set_the_interpreter_as_asked(monkeypatch):
    from tripath.triton_internals import child_environment

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRIPATH_SOME_SETTING", "kept")
    child = child_environment(interpret=True, cache_dir="/c")
    assert child["TRITON_INTERPRET"] == "1" and child["TRITON_CACHE_DIR"] == "/c"
    assert child["TRIPATH_SOME_SETTING"] == "kept"
    assert "TRITON_INTERPRET" not in child_environment(interpret=None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert child_environment(interpret=True)["TRITON_INTERPRET"] == "0"  # the environment's choice stands
    assert child_environment(interpret=None)["TRITON_INTERPRET"] == "0"
    assert "TRITON_INTERPRET" not in child_environment(interpret=False, cache_dir="/c")
    assert child_environment(interpret=False, cache_dir="/c")["TRITON_CACHE_DIR"] == "/c"
