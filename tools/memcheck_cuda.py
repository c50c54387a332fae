"""Run a small case of every CUDA kernel once, for ``compute-sanitizer --tool memcheck``.

Usage (GPU machine; build the extension first so the sanitizer watches only the kernels):
    python -c "from paged_attention.kernels import cuda; print(cuda.available())"
    compute-sanitizer --tool memcheck --error-exitcode 1 python tools/memcheck_cuda.py
Every case writes into tensors sized exactly to what it needs, so an out-of-bounds access is a
memcheck error rather than a silent write into a neighbour. The results are also checked.
"""
import sys

import torch

import paged_attention  # noqa: F401  (device policy first)
from paged_attention.kernels import cuda as ck
from paged_attention.kernels import reference as ref
from paged_attention.kernels.workloads import assert_close_to_oracle, make_decode_problem
from paged_attention.utils import cdiv


def main() -> int:
    ok, why = ck.available()
    if not ok:
        print("CUDA kernels unavailable:", why)
        return 1
    one = torch.ones(1, device="cuda")
    torch.manual_seed(0)

    # Cache writes: 9 tokens (one padding) into 3 blocks of 16; v0 and flash (NHD, HND), fp8 too.
    key, value = torch.randn(2, 9, 4, 64, device="cuda", dtype=torch.float16)
    slots = torch.tensor([0, 5, 17, -1, 47, 30, 31, 16, 2], device="cuda")
    for kv_dtype, cache_dtype in (("auto", torch.float16), ("fp8", torch.uint8)):
        x = ref.v0_x(cache_dtype)
        caches = [torch.zeros(3, 4, 64 // x, 16, x, dtype=cache_dtype, device="cuda"),
                  torch.zeros(3, 4, 64, 16, dtype=cache_dtype, device="cuda")]
        ck.reshape_and_cache(key, value, *caches, slots, kv_dtype, one, one)
        for shape, perm in (((3, 16, 4, 64), None), ((3, 4, 16, 64), (0, 2, 1, 3))):
            flash = [torch.zeros(shape, dtype=cache_dtype, device="cuda") for _ in range(2)]
            flash = [c.permute(*perm) if perm else c for c in flash]
            ck.reshape_and_cache_flash(key, value, *flash, slots, kv_dtype, one, one)
    print("reshape_and_cache, reshape_and_cache_flash: ran")

    # Block copies: 2 layers of 4 blocks; swaps out to pinned memory and back.
    layers = [torch.randn(4, 16, 4, 64, device="cuda") for _ in range(4)]
    ck.copy_blocks(layers[:2], layers[2:], torch.tensor([[0, 3], [1, 2]], device="cuda"))
    assert torch.equal(layers[0][3], layers[0][0])
    host = torch.zeros(2, 16, 4, 64, pin_memory=True)
    ck.swap_blocks(layers[0], host, torch.tensor([[3, 1]]))
    ck.swap_blocks(host, layers[1], host[0].numel() * 4, torch.tensor([[1, 0]]))
    torch.cuda.synchronize()
    assert torch.equal(layers[1][0], layers[0][0])
    print("copy_blocks, swap_blocks: ran")

    # Attention: ragged lengths over exactly as many blocks as needed, every block size.
    for dtype in (torch.float32, torch.bfloat16):
        for block_size in ck.BLOCK_SIZES:
            lens = [1, block_size, 700]
            p = make_decode_problem(lens, num_heads=8, num_kv_heads=2, head_size=128, block_size=block_size,
                                    dtype=dtype, device="cuda")
            # Trim the table to the columns the longest sequence needs: no slack to hide overruns.
            p.block_tables = p.block_tables[:, :cdiv(max(lens), block_size)].contiguous()
            expected = ref.ref_decode_attention(*p.decode_args())
            k, v = ref.flash_to_v0(p.key_cache, p.value_cache)
            common = (2, p.scale, p.block_tables, p.seq_lens, block_size, 700, None, "auto", one, one)
            out = torch.empty_like(p.query)
            ck.paged_attention_v1(out, p.query, k, v, *common)
            assert_close_to_oracle(out, expected, "v1")
            ck.paged_attention_v2(out, *ref.v2_scratch(p.query, 700), p.query, k, v, *common)
            assert_close_to_oracle(out, expected, "v2")
    torch.cuda.synchronize()
    print("paged_attention_v1, paged_attention_v2: ran and matched the oracle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
