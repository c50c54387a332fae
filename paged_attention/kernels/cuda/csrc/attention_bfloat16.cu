// Paged attention v1/v2 compiled for __nv_bfloat16 elements (one file per type: they build in parallel).
#include "attention.cuh"

namespace paged_attention {
void paged_attention_bfloat16(const AttentionArgs& a) { dispatch_paged_attention<__nv_bfloat16>(a); }
}  // namespace paged_attention
