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


# Hugging Face transformers loading the packaged GGUF: the oracle nobody here wrote. Loading the
# model takes ~15 s (it dequantises every tensor), so once per session, shared by the model and
# engine tests.
@pytest.fixture(scope="session")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    from paged_attention.model.weights import packaged_model_path
    path = packaged_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_model():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    from paged_attention.model.weights import packaged_model_path
    path = packaged_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()
