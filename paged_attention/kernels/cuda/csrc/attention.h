// The host-side interface of the paged-attention kernels: one argument bundle and the entry point.
#pragma once

#include <torch/extension.h>

namespace paged_attention {

struct AttentionArgs {
  torch::Tensor out;           // [num_seqs, num_heads, head_size]
  torch::Tensor exp_sums;      // v2: float32 [num_seqs, num_heads, num_partitions]
  torch::Tensor max_logits;    // v2: float32 [num_seqs, num_heads, num_partitions]
  torch::Tensor tmp_out;       // v2: [num_seqs, num_heads, num_partitions, head_size]
  torch::Tensor query;         // [num_seqs, num_heads, head_size], any seq/head stride
  torch::Tensor key_cache;     // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  torch::Tensor value_cache;   // [num_blocks, num_kv_heads, head_size, block_size]
  torch::Tensor block_tables;  // int32 [num_seqs, max_num_blocks_per_seq]
  torch::Tensor seq_lens;      // int32 [num_seqs]
  c10::optional<torch::Tensor> alibi_slopes;  // float32 [num_heads]
  int num_kv_heads;
  double scale;
  int block_size;
  int max_seq_len;
  bool v2;
};

// Entry point: picks how many query heads a thread block takes, then the compiled instance.
void paged_attention(const AttentionArgs& a);

// One instance per (element type, heads per thread block), each in its own file
// (attention_<type>_g<GROUP>.cu) so that they compile in parallel.
template <typename scalar_t, int GROUP>
void dispatch_paged_attention(const AttentionArgs& a);

}  // namespace paged_attention
