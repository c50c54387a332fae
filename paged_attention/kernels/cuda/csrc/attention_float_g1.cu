// Paged attention v1/v2 for float elements, 1 query head(s) per thread block.
#include "attention.cuh"

namespace paged_attention {
template void dispatch_paged_attention<float, 1>(const AttentionArgs& a);
}  // namespace paged_attention
