// Paged attention v1/v2 compiled for __half elements (one file per type: they build in parallel).
#include "attention.cuh"

namespace paged_attention {
void paged_attention_half(const AttentionArgs& a) { dispatch_paged_attention<__half>(a); }
}  // namespace paged_attention
