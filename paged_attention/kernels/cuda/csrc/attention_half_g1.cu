// Paged attention v1/v2 for __half elements, 1 query head(s) per thread block.
#include "attention.cuh"

namespace paged_attention {
template void dispatch_paged_attention<__half, 1>(const AttentionArgs& a);
}  // namespace paged_attention
