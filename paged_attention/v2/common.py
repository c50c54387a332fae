"""What both kernel sets of v2's block tables share: ``BlockTables`` (vLLM's kernels) and
``FastBlockTables`` (ours) import these, and neither imports the other's module for them.

* ``capturing``: whether a CUDA graph is being captured (then nothing can be read on the host);
* ``load_ptr``: the Triton helper that turns an entry of a pointer table back into a pointer;
* ``SlotProgram``: one program of a slot-mapping launch, so that both grids can be listed and
  drawn side by side.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured (then tensors cannot be read on the host)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SlotProgram(NamedTuple):
    """One program of a slot-mapping launch and the slots ``[start, stop)`` it writes: ``pid``
    its program id, ``group`` the group it writes (None: every group), ``kind`` ``"request"``
    (one request's tokens), ``"padding"`` (the tail) or ``"tile"`` (a run of slots, any kind)."""
    pid: tuple
    group: Optional[int]
    start: int
    stop: int
    kind: str


@triton.jit
def load_ptr(ptr_to_ptr, elem_dtype):
    # A pointer table holds addresses as uint64: load one and make it a typed pointer again.
    ptr = tl.load(ptr_to_ptr)
    ptr = tl.cast(ptr, tl.pointer_type(elem_dtype))
    # Device allocations are aligned (256 bytes in torch): tell the compiler it may vectorise.
    return tl.multiple_of(ptr, 16)
