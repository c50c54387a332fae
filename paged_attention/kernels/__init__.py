"""Kernels that read and write a paged KV cache.

``reference`` (plain torch, runs anywhere) is the oracle; ``triton`` runs compiled on a GPU and
in Triton's interpreter on a CPU; ``cuda`` holds CUDA C++ kernels built on first use on a GPU;
``vllm`` loads vLLM's own compiled kernels where they can be found. ``args`` holds the argument
checks all four share, and ``layout`` the arithmetic of the CUDA kernels' cache layout.

How a Triton kernel is launched, everywhere in the package (here and in ``v2``), by one rule:

* A front-end whose kernel a model calls every step with the same shapes makes a **plan**: its
  checks run once, and a ``Launcher`` (``paged_attention.triton_launch``) holds the fixed
  arguments; each later call only launches through it. These are ``triton.decode.DecodePlan``,
  ``triton.prefill.PrefillPlan``, ``triton.cache.CacheWritePlan`` and ``v2.FastBlockTables`` (its
  launchers kept per tile shape); the plans' shared parts are in ``triton.launch``.
* Every other kernel is launched with Triton's own ``kernel[grid](...)`` from its checked
  front-end: the layer ops and the fused projections (the model's ``FusedLayerOps`` keeps
  ``Launcher``s of them, and the engine replays its steps from CUDA graphs on a GPU, where no
  host code runs), the v2 kernels shaped like vLLM's (kept as vLLM writes them) and
  ``StagedWriteTensor``'s apply.

Nothing else calls a compiled kernel: the Triton internals that a direct launch needs are reached
only through ``triton_launch.direct_launch_api``, which falls back to Triton's own path on a
Triton release it was not checked on. What the Triton attention kernels share (reading keys and
values through a block table, the base-2 scale, the dtype check) is in ``triton.common``.

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
