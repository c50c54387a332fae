// Paged attention v1/v2 compiled for float elements (one file per type: they build in parallel).
#include "attention.cuh"

namespace paged_attention {
void paged_attention_float(const AttentionArgs& a) { dispatch_paged_attention<float>(a); }
}  // namespace paged_attention
