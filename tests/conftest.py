import sys

import matplotlib

matplotlib.use("Agg")  # before any pyplot import: no window, same pixels everywhere

import pytest  # noqa: E402
import torch  # noqa: E402

import paged_attention  # noqa: F401  (decides the device and the Triton mode first)
from paged_attention import runtime  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if runtime.HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def close_figures():
    """Every test leaves no figure open (the drawing tests make many)."""
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


@pytest.fixture
def device() -> torch.device:
    return runtime.DEVICE


def dtype_params(include_fp32: bool = True):
    """fp32 and fp16 everywhere; bf16 only compiled on a GPU (the interpreter has no bf16)."""
    params = [torch.float32] if include_fp32 else []
    params += [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.cuda, id="bfloat16")]
    return params


# A message with a ';' in it: a skip reason must come through whole, not cut at the first ';'.
PLANTED = "planted by a test; this second half must be reported too"


def planted(error: type[Exception]):
    """A kernel that raises ``error(PLANTED)`` whatever it is given: planted in place of a real
    one, it must be reported FAILED (``ValueError``: a bug on good input) or skipped
    (``KernelUnavailable``), never the other way round."""
    def kernel(*args, **kwargs):
        raise error(PLANTED)
    return kernel
