"""Kernels that read and write a paged KV cache.

``reference`` (plain torch, runs anywhere) is the oracle; ``triton`` runs compiled on a GPU and
in Triton's interpreter on a CPU; ``cuda`` holds CUDA C++ kernels built on first use on a GPU;
``vllm`` loads vLLM's own compiled kernels where they can be found. ``args`` holds the argument
checks all four share, and ``layout`` the arithmetic of the CUDA kernels' cache layout.

Two kinds of error come out of a kernel, and they mean different things:

* ``ValueError`` / ``TypeError``: the arguments are wrong for the operation, whoever runs it
  (a block id outside the cache, a key of the wrong dtype). Every implementation refuses them
  alike, in the same shared checks, before anything is written.
* :class:`KernelUnavailable`: the arguments are fine, but *this* implementation cannot run them
  *here*: no GPU, vLLM's library not found, a head size it was not compiled for, a feature it
  does not have (ALiBi in FA3, fp8 in Triton). The verification helpers list such an
  implementation as skipped, with this message; any other exception is a failure.
"""


class KernelUnavailable(RuntimeError):
    """This implementation cannot run these (valid) arguments on this machine; the message says
    why and what to use instead."""
