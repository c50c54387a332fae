# ruff: noqa: F821  (a lab cell: the name comes from the notebook's import cell)
# torch comes from the notebook's first code cell; the kernel lives in this cell.
import triton
import triton.language as tl


@triton.jit
def _slots(table_ptr, req_ptr, pos_ptr, out_ptr, n, stride, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    mask = offs < n
    req = tl.load(req_ptr + offs, mask=mask, other=0)
    pos = tl.load(pos_ptr + offs, mask=mask, other=0)
    block = tl.load(table_ptr + req * stride + pos // BLOCK_SIZE, mask=mask, other=0)
    tl.store(out_ptr + offs, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)


def triton_slot_mapping(block_table, req_indices, positions, block_size):
    n = positions.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=positions.device)
    _slots[(triton.cdiv(n, 128),)](block_table, req_indices, positions, out, n, block_table.stride(0),
                                   BLOCK_SIZE=block_size, TILE=128)
    return out
