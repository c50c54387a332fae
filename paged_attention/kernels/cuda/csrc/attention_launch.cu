// Choosing the launch: the element type and how many query heads one thread block takes.
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention.h"

namespace paged_attention {

namespace {
constexpr int kNumWarps = 4;   // as in attention.cuh

// Query heads per thread block: 4 of a GQA group share every K/V load where the group size
// allows it; 1 is vLLM's mapping. v1 keeps GROUP x max_seq_len scores in shared memory and falls
// back to 1 head when 4 would not fit.
int choose_group(const AttentionArgs& a) {
  const int per_kv_head = a.query.size(1) / a.num_kv_heads;
  const int head_size = a.query.size(2);
  if (per_kv_head % 4 != 0) return 1;
  if (a.v2) return 4;
  int device = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t tokens = (size_t)(a.max_seq_len + a.block_size - 1) / a.block_size * a.block_size;
  // scores + q_s + red_s for 4 heads, plus alignment slack
  const size_t need = sizeof(float) * (4 * tokens + 4 * head_size + 4 * kNumWarps) + 64;
  return need <= (size_t)optin ? 4 : 1;
}
}  // namespace

void paged_attention(const AttentionArgs& a) {
  const bool four = choose_group(a) == 4;
  switch (a.query.scalar_type()) {
    case at::kFloat: return four ? dispatch_paged_attention<float, 4>(a) : dispatch_paged_attention<float, 1>(a);
    case at::kHalf: return four ? dispatch_paged_attention<__half, 4>(a) : dispatch_paged_attention<__half, 1>(a);
    case at::kBFloat16:
      return four ? dispatch_paged_attention<__nv_bfloat16, 4>(a) : dispatch_paged_attention<__nv_bfloat16, 1>(a);
    default: TORCH_CHECK(false, "Unsupported query dtype: ", a.query.scalar_type());
  }
}

}  // namespace paged_attention
