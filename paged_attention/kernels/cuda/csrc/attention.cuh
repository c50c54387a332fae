// Paged attention v1 and v2 for one decode step over vLLM's v0 cache layout (vLLM's
// csrc/attention/attention_kernels.cuh does the same work; this is written to be read).
//
// Work split. One thread block of 128 threads (4 warps) computes one query head of one sequence
// (v1), or of one 512-token partition of it (v2): grid = (num_heads, num_seqs, num_partitions).
// That is vLLM's mapping (GROUP = 1). With grouped-query attention several query heads read the
// same KV head; with GROUP = 4 a thread block computes four of them, so that each key and value
// it loads serves four heads: a quarter of the loads and conversions per head. Inside it:
//   1. q . k  Warps take the sequence's KV blocks round-robin (warp w: blocks w, w+4, ...). A
//             warp holds one block at a time: each of its 32 lanes belongs to a "thread group" of
//             THREAD_GROUP_SIZE = 32 / BLOCK_SIZE lanes that owns one token of the block, so the
//             warp covers the block's BLOCK_SIZE tokens exactly. The group reads its token's key
//             in 16-byte x-chunks, each lane VEC = x / THREAD_GROUP_SIZE elements of every chunk,
//             and adds up its partial dot products with shuffles. Scores go to shared memory.
//   2. softmax over the scores in shared memory (max, exp, sum: block-wide reductions).
//   3. p . v  Here the warps split the head's dimensions rather than the blocks (vLLM's warps
//             take blocks round-robin again and add their outputs up through shared memory).
//             The value cache stores a block's tokens innermost ([D, B]), so a lane reads V_VEC
//             consecutive tokens of one dimension in one 16-byte load; each warp walks every
//             block but reads only its own rows, so its sums need no cross-warp step, and a lane
//             keeps a few accumulators rather than a whole head's worth (fewer registers, more
//             thread blocks resident per SM, more loads in flight).
// v2 writes each partition's max score, exp-sum and locally normalised output; a second kernel
// rescales the partitions to a common maximum and adds them up.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "attention.h"
#include "common.cuh"

namespace paged_attention {

constexpr int NUM_THREADS = 128;
constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
constexpr int PARTITION_SIZE = 512;      // v2's tokens per partition (a multiple of every block size)
constexpr float SOFTMAX_EPS = 1e-6f;     // vLLM's guard in the softmax denominator

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

// Thread blocks per SM the compiler must leave registers for (8 caps a thread at 64 registers).
// A decode step is bound by the loads in flight. v2 has many thread blocks, and more of them
// resident puts more loads in flight than a deeper unroll of the value loop (UNROLL) does: on an
// H200, 64 registers gave 0.82 of copy bandwidth at batch 64 x 4096 against 0.70 with the 113
// the compiler picks alone. v1 has few thread blocks, limited by their shared memory anyway, so
// each lane unrolls deeper instead. A thread's share of a KV block grows with the block's bytes,
// and so does its register need.
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int PARTITION>
constexpr int min_blocks_per_sm() {
  constexpr int bytes = HEAD_SIZE * BLOCK_SIZE * sizeof(scalar_t);   // one head's K (or V) block
  constexpr int v2 = bytes <= 4096 ? 8 : bytes <= 8192 ? 4 : 2;
  return PARTITION > 0 ? v2 : (v2 > 2 ? v2 / 2 : v2);
}

// PARTITION == 0: v1, the whole sequence in one thread block, output straight to `out`.
// PARTITION  > 0: v2, partition blockIdx.z only, output to tmp_out, exp_sums, max_logits.
// GROUP: query heads per thread block, all of one KV head (GQA). Each key and value element is
// loaded and converted once and used for all GROUP heads; GROUP = 1 is vLLM's own mapping.
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int PARTITION, int GROUP>
__global__ void __launch_bounds__(NUM_THREADS, min_blocks_per_sm<scalar_t, HEAD_SIZE, BLOCK_SIZE, PARTITION>()) paged_attention_kernel(
    float* __restrict__ exp_sums,            // v2: [num_seqs, num_heads, num_partitions]
    float* __restrict__ max_logits,          // v2: [num_seqs, num_heads, num_partitions]
    scalar_t* __restrict__ out,              // v1: out; v2: tmp_out [.., num_partitions, HEAD_SIZE]
    const scalar_t* __restrict__ q,          // [num_seqs, num_heads, HEAD_SIZE]
    const scalar_t* __restrict__ k_cache,    // [num_blocks, num_kv_heads, HEAD_SIZE / x, BLOCK_SIZE, x]
    const scalar_t* __restrict__ v_cache,    // [num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE]
    int num_kv_heads, float scale,
    const int* __restrict__ block_tables,    // [num_seqs, max_num_blocks_per_seq]
    const int* __restrict__ seq_lens,        // [num_seqs]
    int max_num_blocks_per_seq,
    const float* __restrict__ alibi_slopes,  // [num_heads] or nullptr
    int64_t q_stride, int64_t q_head_stride, int64_t kv_block_stride, int64_t kv_head_stride) {
  static_assert(BLOCK_SIZE <= WARP_SIZE && WARP_SIZE % BLOCK_SIZE == 0, "block size must divide 32");
  constexpr int X = 16 / sizeof(scalar_t);                    // elements per 16-byte key chunk
  constexpr int THREAD_GROUP_SIZE = WARP_SIZE / BLOCK_SIZE;   // lanes per token: 4, 2, 1
  constexpr int VEC = X / THREAD_GROUP_SIZE;                  // elements per lane per chunk
  constexpr int NUM_CHUNKS = HEAD_SIZE / X;                   // x-chunks per key
  static_assert(HEAD_SIZE % X == 0, "head size must be a multiple of x");
  // Key chunks loaded ahead of use: up to 128 bytes per lane (more only costs registers).
  constexpr int K_UNROLL = NUM_CHUNKS < 128 / (VEC * (int)sizeof(scalar_t)) ? NUM_CHUNKS : 128 / (VEC * (int)sizeof(scalar_t));
  static_assert(PARTITION % BLOCK_SIZE == 0, "a partition holds whole blocks");

  const int first_head = blockIdx.x * GROUP, seq = blockIdx.y, part = blockIdx.z;
  const int num_heads = gridDim.x * GROUP, num_partitions = gridDim.z;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;

  // ---- Which tokens this thread block covers --------------------------------------------------
  const int seq_len = seq_lens[seq];
  if (PARTITION > 0 && part * PARTITION >= seq_len) return;   // partition past the sequence's end
  const int seq_blocks = cdiv(seq_len, BLOCK_SIZE);
  const int start_block = PARTITION > 0 ? part * (PARTITION / BLOCK_SIZE) : 0;
  const int end_block = PARTITION > 0 ? min(start_block + PARTITION / BLOCK_SIZE, seq_blocks) : seq_blocks;
  const int start_token = start_block * BLOCK_SIZE;
  const int num_tokens = min(end_block * BLOCK_SIZE, seq_len) - start_token;
  const int span = (end_block - start_block) * BLOCK_SIZE;     // scores kept per head (whole blocks)

  const int kv_head = first_head / (num_heads / num_kv_heads);  // GQA: query heads share a KV head
  float slope[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) slope[g] = alibi_slopes == nullptr ? 0.f : alibi_slopes[first_head + g];
  const int* table = block_tables + (int64_t)seq * max_num_blocks_per_seq;

  extern __shared__ __align__(16) float logits[];      // [GROUP][span]: a score, then a probability, per token
  __shared__ __align__(32) float q_s[GROUP][HEAD_SIZE];
  __shared__ float red_s[NUM_WARPS * GROUP];

  for (int i = threadIdx.x; i < GROUP * HEAD_SIZE; i += NUM_THREADS) {
    const int g = i / HEAD_SIZE, d = i % HEAD_SIZE;
    q_s[g][d] = to_float(q[seq * q_stride + (first_head + g) * q_head_stride + d]);
  }
  __syncthreads();

  // ---- 1. Scores: q . k for every token --------------------------------------------------------
  const int token_in_block = lane / THREAD_GROUP_SIZE;   // the token this lane's group owns
  const int member = lane % THREAD_GROUP_SIZE;           // which VEC-slice of each chunk it reads
  float qk_max[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) qk_max[g] = -INFINITY;
  for (int b = start_block + warp; b < end_block; b += NUM_WARPS) {
    const int64_t physical = table[b];
    // Chunk c of token t starts at ((c * BLOCK_SIZE) + t) * X in the [D/x, B, x] panel.
    const scalar_t* k_ptr = k_cache + physical * kv_block_stride + kv_head * kv_head_stride +
                            token_in_block * X + member * VEC;
    float qk[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) qk[g] = 0.f;
#pragma unroll K_UNROLL
    for (int c = 0; c < NUM_CHUNKS; ++c) {
      const Vec<scalar_t, VEC> k = load_vec<scalar_t, VEC>(k_ptr + c * BLOCK_SIZE * X);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const Vec<float, VEC> qv = load_vec<float, VEC>(&q_s[g][c * X + member * VEC]);
#pragma unroll
        for (int i = 0; i < VEC; ++i) qk[g] += qv.e[i] * to_float(k.e[i]);
      }
    }
    const int token = b * BLOCK_SIZE + token_in_block;
    const bool valid = token < seq_len;                  // the last block may be partly filled
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      // The group's lanes add up their partial dots; ALiBi adds slope * (j - seq_len + 1).
      const float s = scale * warp_sum<THREAD_GROUP_SIZE>(qk[g]) + slope[g] * (float)(token - seq_len + 1);
      if (member == 0) logits[g * span + token - start_token] = valid ? s : 0.f;
      if (valid) qk_max[g] = fmaxf(qk_max[g], s);
    }
  }
  block_reduce_group<NUM_WARPS, GROUP, true>(qk_max, red_s);   // (its barriers publish `logits`)

  // ---- 2. Softmax with vLLM's +1e-6 in the denominator ------------------------------------------
  float exp_sum[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    exp_sum[g] = 0.f;
    for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) {
      const float e = expf(logits[g * span + i] - qk_max[g]);
      logits[g * span + i] = e;
      exp_sum[g] += e;
    }
  }
  block_reduce_group<NUM_WARPS, GROUP, false>(exp_sum, red_s);
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const float inv_sum = 1.f / (exp_sum[g] + SOFTMAX_EPS);
    for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) logits[g * span + i] *= inv_sum;
    if (PARTITION > 0 && threadIdx.x == 0) {
      const int64_t idx = ((int64_t)seq * num_heads + first_head + g) * num_partitions + part;
      max_logits[idx] = qk_max[g];
      exp_sums[idx] = exp_sum[g];
    }
  }
  __syncthreads();

  // ---- 3. Output: sum_j p_j v_j ---------------------------------------------------------------
  // Here the warps split the head's dimensions instead of the blocks: every warp walks all of the
  // blocks, but reads only its own rows of each [D, B] value panel, so its sums are final (no
  // cross-warp reduction) and a lane keeps a few accumulators instead of a whole head's worth.
  // A "row pass" is what a warp covers with one load per lane: ROWS_PER_PASS rows, VECS_PER_ROW
  // lanes per row, each lane V_VEC consecutive tokens (one 16-byte load). Passes go round-robin
  // to the warps (warp w: passes w, w + 4, ...).
  constexpr int V_VEC = (16 / sizeof(scalar_t)) < BLOCK_SIZE ? 16 / sizeof(scalar_t) : BLOCK_SIZE;
  constexpr int VECS_PER_ROW = BLOCK_SIZE / V_VEC;          // lanes sharing one dimension's row
  constexpr int ROWS_PER_PASS = WARP_SIZE / VECS_PER_ROW;   // dimensions a warp covers per load
  constexpr int ROW_PASSES = cdiv(HEAD_SIZE, ROWS_PER_PASS);
  constexpr int PASSES_PER_WARP = cdiv(ROW_PASSES, NUM_WARPS);
  // Blocks whose loads are all issued before any is used: about 4 (v2) or 8 (v1) 16-byte
  // loads in flight per lane (see min_blocks_per_sm).
  constexpr int UNROLL = cdiv(PARTITION > 0 ? 4 : 8, PASSES_PER_WARP);
  const int first_token = (lane % VECS_PER_ROW) * V_VEC;  // of each block, for this lane
  int row[PASSES_PER_WARP];
  float acc[GROUP][PASSES_PER_WARP];
#pragma unroll
  for (int r = 0; r < PASSES_PER_WARP; ++r) {
    const int pass = warp + r * NUM_WARPS;
    row[r] = pass < ROW_PASSES ? pass * ROWS_PER_PASS + lane / VECS_PER_ROW : HEAD_SIZE;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) acc[g][r] = 0.f;
  }
  const scalar_t* v_head = v_cache + kv_head * kv_head_stride + first_token;
  for (int b0 = start_block; b0 < end_block; b0 += UNROLL) {
    // Issue the loads of UNROLL blocks first: a warp then has several 16-byte loads in flight
    // per lane, which is what hides the memory latency.
    Vec<scalar_t, V_VEC> v[UNROLL][PASSES_PER_WARP];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const bool in = b0 + u < end_block;
      const int64_t physical = in ? table[b0 + u] : 0;
#pragma unroll
      for (int r = 0; r < PASSES_PER_WARP; ++r) {
        // Row d of the [D, B] panel holds dimension d of all the block's tokens.
        if (in && row[r] < HEAD_SIZE) {
          v[u][r] = load_vec<scalar_t, V_VEC>(v_head + physical * kv_block_stride + row[r] * BLOCK_SIZE);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int b = b0 + u;
      if (b >= end_block) break;
      const int token0 = b * BLOCK_SIZE + first_token;
      const bool last = b == seq_blocks - 1;              // only the final block can be partial
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const Vec<float, V_VEC> p = load_vec<float, V_VEC>(&logits[g * span + token0 - start_token]);
#pragma unroll
        for (int r = 0; r < PASSES_PER_WARP; ++r) {
#pragma unroll
          for (int j = 0; j < V_VEC; ++j) {
            // Slots past seq_len hold whatever was there (maybe NaN bits): p = 0 is not enough.
            const float vf = (last && token0 + j >= seq_len) ? 0.f : to_float(v[u][r].e[j]);
            acc[g][r] += p.e[j] * vf;
          }
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int r = 0; r < PASSES_PER_WARP; ++r) {
      const float sum = warp_sum<VECS_PER_ROW>(acc[g][r]);   // lanes that own the same row
      if (lane % VECS_PER_ROW == 0 && row[r] < HEAD_SIZE) {
        const int64_t head_row = (int64_t)seq * num_heads + first_head + g;
        const int64_t out_row = PARTITION > 0 ? head_row * num_partitions + part : head_row;
        out[out_row * HEAD_SIZE + row[r]] = from_float<scalar_t>(sum);
      }
    }
  }
}

// v2's reduction, one thread block per (head, sequence). Partition p was normalised by its own
// sum s_p at its own maximum m_p. Rescaled to the global maximum M its weight is
// w_p = s_p * exp(m_p - M), and out = sum_p w_p * tmp_out_p / (sum_p w_p + 1e-6).
template <typename scalar_t>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_reduce_kernel(
    scalar_t* __restrict__ out, const float* __restrict__ exp_sums,
    const float* __restrict__ max_logits, const scalar_t* __restrict__ tmp_out,
    const int* __restrict__ seq_lens, int num_partitions, int head_size) {
  const int head = blockIdx.x, seq = blockIdx.y, num_heads = gridDim.x;
  const int64_t row = (int64_t)seq * num_heads + head;
  const int n = cdiv(seq_lens[seq], PARTITION_SIZE);
  scalar_t* o = out + row * head_size;
  const scalar_t* partial = tmp_out + row * num_partitions * head_size;
  if (n == 1) {                              // one partition: its output is already final
    for (int d = threadIdx.x; d < head_size; d += NUM_THREADS) o[d] = partial[d];
    return;
  }
  extern __shared__ float weights[];         // w_p, one per partition
  __shared__ float red_s[NUM_WARPS];
  const float* m = max_logits + row * num_partitions;
  const float* s = exp_sums + row * num_partitions;
  float global_max = -INFINITY;
  for (int p = threadIdx.x; p < n; p += NUM_THREADS) global_max = fmaxf(global_max, m[p]);
  global_max = block_reduce<NUM_WARPS, true>(global_max, red_s);
  float total = 0.f;
  for (int p = threadIdx.x; p < n; p += NUM_THREADS) {
    const float w = s[p] * expf(m[p] - global_max);
    weights[p] = w;
    total += w;
  }
  total = block_reduce<NUM_WARPS, false>(total, red_s);   // its barriers publish `weights`
  const float inv_total = 1.f / (total + SOFTMAX_EPS);
  for (int d = threadIdx.x; d < head_size; d += NUM_THREADS) {
    float acc = 0.f;
    for (int p = 0; p < n; ++p) acc += weights[p] * to_float(partial[p * head_size + d]);
    o[d] = from_float<scalar_t>(acc * inv_total);
  }
}

// ---- Host side ----------------------------------------------------------------------------------
// Shared memory a launch needs: the dynamic scores (GROUP heads x the tokens of the longest
// sequence or of one partition) next to the kernel's static arrays.
inline size_t scores_bytes(int group, int tokens) { return (size_t)group * tokens * sizeof(float); }

template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int GROUP>
void launch_paged_attention(const AttentionArgs& a) {
  const c10::cuda::OptionalCUDAGuard guard(device_of(a.query));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int num_seqs = a.query.size(0), num_heads = a.query.size(1);
  const float* alibi = a.alibi_slopes.has_value() ? a.alibi_slopes->data_ptr<float>() : nullptr;
  auto ptr = [](const torch::Tensor& t) { return reinterpret_cast<scalar_t*>(t.data_ptr()); };
  const auto* q = ptr(a.query);
  const auto* k = ptr(a.key_cache);
  const auto* v = ptr(a.value_cache);
  const int* tables = a.block_tables.data_ptr<int>();
  const int* lens = a.seq_lens.data_ptr<int>();
  const int max_blocks = a.block_tables.size(1);
  const float scale = static_cast<float>(a.scale);
  const dim3 heads_and_seqs(num_heads / GROUP, num_seqs);
  if (!a.v2) {
    // v1 keeps a score per token of the longest sequence (per head) in shared memory.
    auto kernel = paged_attention_kernel<scalar_t, HEAD_SIZE, BLOCK_SIZE, 0, GROUP>;
    const size_t smem = scores_bytes(GROUP, cdiv(a.max_seq_len, BLOCK_SIZE) * BLOCK_SIZE);
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    }
    kernel<<<heads_and_seqs, NUM_THREADS, smem, stream>>>(
        nullptr, nullptr, ptr(a.out), q, k, v, a.num_kv_heads, scale, tables, lens, max_blocks, alibi,
        a.query.stride(0), a.query.stride(1), a.key_cache.stride(0), a.key_cache.stride(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    const int num_partitions = cdiv(a.max_seq_len, PARTITION_SIZE);
    paged_attention_kernel<scalar_t, HEAD_SIZE, BLOCK_SIZE, PARTITION_SIZE, GROUP>
        <<<dim3(num_heads / GROUP, num_seqs, num_partitions), NUM_THREADS, scores_bytes(GROUP, PARTITION_SIZE),
           stream>>>(
            a.exp_sums.data_ptr<float>(), a.max_logits.data_ptr<float>(), ptr(a.tmp_out), q, k, v,
            a.num_kv_heads, scale, tables, lens, max_blocks, alibi, a.query.stride(0), a.query.stride(1),
            a.key_cache.stride(0), a.key_cache.stride(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // The weights' array is padded to whole float4s: the compiler may read it four at a time.
    const size_t reduce_smem = (size_t)(cdiv(num_partitions, 4) + 1) * 4 * sizeof(float);
    paged_attention_v2_reduce_kernel<scalar_t><<<dim3(num_heads, num_seqs), NUM_THREADS, reduce_smem, stream>>>(
        ptr(a.out), a.exp_sums.data_ptr<float>(), a.max_logits.data_ptr<float>(), ptr(a.tmp_out), lens,
        num_partitions, HEAD_SIZE);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The compiled (head size, block size) pairs: the sizes vLLM compiles its own kernels for.
template <typename scalar_t, int GROUP, int HEAD_SIZE>
void dispatch_block_size(const AttentionArgs& a) {
  switch (a.block_size) {
    case 8: return launch_paged_attention<scalar_t, HEAD_SIZE, 8, GROUP>(a);
    case 16: return launch_paged_attention<scalar_t, HEAD_SIZE, 16, GROUP>(a);
    case 32: return launch_paged_attention<scalar_t, HEAD_SIZE, 32, GROUP>(a);
    default: TORCH_CHECK(false, "Unsupported block size: ", a.block_size);
  }
}

template <typename scalar_t, int GROUP>
void dispatch_paged_attention(const AttentionArgs& a) {
  switch (a.query.size(2)) {
    case 32: return dispatch_block_size<scalar_t, GROUP, 32>(a);
    case 64: return dispatch_block_size<scalar_t, GROUP, 64>(a);
    case 80: return dispatch_block_size<scalar_t, GROUP, 80>(a);
    case 96: return dispatch_block_size<scalar_t, GROUP, 96>(a);
    case 112: return dispatch_block_size<scalar_t, GROUP, 112>(a);
    case 120: return dispatch_block_size<scalar_t, GROUP, 120>(a);
    case 128: return dispatch_block_size<scalar_t, GROUP, 128>(a);
    case 192: return dispatch_block_size<scalar_t, GROUP, 192>(a);
    case 256: return dispatch_block_size<scalar_t, GROUP, 256>(a);
    default: TORCH_CHECK(false, "Unsupported head size: ", a.query.size(2));
  }
}

}  // namespace paged_attention
