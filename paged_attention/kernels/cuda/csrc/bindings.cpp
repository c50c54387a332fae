// The Python entry points of the extension. Arguments arrive checked by the Python wrappers in
// paged_attention/kernels/cuda/__init__.py; these functions only unpack and dispatch.
#include <torch/extension.h>

#include "attention.h"

namespace paged_attention {

void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor slot_mapping, int64_t kv_code,
                       torch::Tensor k_scale, torch::Tensor v_scale);
void reshape_and_cache_flash(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor slot_mapping, int64_t kv_code,
                             torch::Tensor k_scale, torch::Tensor v_scale);
void copy_blocks(torch::Tensor key_cache_ptrs, torch::Tensor value_cache_ptrs,
                 torch::Tensor block_mapping, int64_t bytes_per_block, bool aligned16);
void swap_blocks(torch::Tensor src, torch::Tensor dst, int64_t block_size_in_bytes,
                 torch::Tensor block_mapping);

// v1 when exp_sums/max_logits/tmp_out are None, v2 otherwise.
void paged_attention_op(torch::Tensor out, c10::optional<torch::Tensor> exp_sums,
                     c10::optional<torch::Tensor> max_logits, c10::optional<torch::Tensor> tmp_out,
                     torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                     int64_t num_kv_heads, double scale, torch::Tensor block_tables,
                     torch::Tensor seq_lens, int64_t block_size, int64_t max_seq_len,
                     c10::optional<torch::Tensor> alibi_slopes) {
  AttentionArgs a;
  a.v2 = exp_sums.has_value();
  a.out = out;
  if (a.v2) {
    a.exp_sums = *exp_sums;
    a.max_logits = *max_logits;
    a.tmp_out = *tmp_out;
  }
  a.query = query;
  a.key_cache = key_cache;
  a.value_cache = value_cache;
  a.block_tables = block_tables;
  a.seq_lens = seq_lens;
  a.alibi_slopes = alibi_slopes;
  a.num_kv_heads = num_kv_heads;
  a.scale = scale;
  a.block_size = block_size;
  a.max_seq_len = max_seq_len;
  paged_attention(a);
}

}  // namespace paged_attention

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "paged_attention's CUDA kernels (cache writes, block copies, paged attention v1/v2)";
  m.def("reshape_and_cache", &paged_attention::reshape_and_cache);
  m.def("reshape_and_cache_flash", &paged_attention::reshape_and_cache_flash);
  m.def("copy_blocks", &paged_attention::copy_blocks);
  m.def("swap_blocks", &paged_attention::swap_blocks);
  m.def("paged_attention", &paged_attention::paged_attention_op);
}
