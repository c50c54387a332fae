// Cache writes and block copies: vLLM's csrc/cache_kernels.cu ops, with the same signatures.
//
// reshape_and_cache        one thread block per new token: scatter its keys and values into
//                          vLLM's v0 layout (key [N, H, D/x, B, x], value [N, H, D, B]).
// reshape_and_cache_flash  the same into the flash layout [N, B, H, D], any strides (NHD, HND).
// copy_blocks              copy-on-write: block src -> block dst, every layer, one launch.
// swap_blocks              whole blocks between GPU and (pinned) CPU memory, one memcpy each.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "common.cuh"

namespace paged_attention {

// ------------------------------------------------------------------------------------------------
// reshape_and_cache: v0 layout
// ------------------------------------------------------------------------------------------------
// Thread i of token t's block handles element i of the flattened [num_heads, head_size] row,
// in a stride loop so that every element is written however large num_heads * head_size is
// (vLLM's kernel of October 2025 launched one thread per element with no such loop, so rows
// longer than a thread block were only partly written).
template <typename scalar_t, KvDtype KV>
__global__ void reshape_and_cache_kernel(
    const scalar_t* __restrict__ key,             // [num_tokens, num_heads, head_size], row stride key_stride
    const scalar_t* __restrict__ value,           // same, row stride value_stride
    typename CacheElement<scalar_t, KV>::type* __restrict__ key_cache,    // [N, H, D/x, B, x]
    typename CacheElement<scalar_t, KV>::type* __restrict__ value_cache,  // [N, H, D, B]
    const int64_t* __restrict__ slot_mapping,     // [num_tokens]
    int64_t key_stride, int64_t value_stride, int num_heads, int head_size, int block_size, int x,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;                          // padding token: nothing to write
  const int64_t block = slot / block_size;
  const int64_t offset = slot % block_size;
  const float ks = KV == KvDtype::kAuto ? 1.f : *k_scale;
  const float vs = KV == KvDtype::kAuto ? 1.f : *v_scale;
  const int n = num_heads * head_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t h = i / head_size;
    const int d = i % head_size;
    const int64_t bh = block * num_heads + h;    // which [D/x, B, x] (or [D, B]) panel
    // Key element d sits in x-chunk d / x, in that chunk's row for this token, at d % x: the
    // x-chunks of all tokens of a block are side by side, so a warp reading chunk c of many
    // tokens reads one contiguous span.
    const int64_t k_idx = ((bh * (head_size / x) + d / x) * block_size + offset) * x + d % x;
    // Value element d of the block's tokens is one row of block_size consecutive numbers.
    const int64_t v_idx = (bh * head_size + d) * block_size + offset;
    key_cache[k_idx] = to_cache<scalar_t, KV>(key[token * key_stride + i], ks);
    value_cache[v_idx] = to_cache<scalar_t, KV>(value[token * value_stride + i], vs);
  }
}

// ------------------------------------------------------------------------------------------------
// reshape_and_cache_flash: [N, B, H, D] with arbitrary block/page/head strides
// ------------------------------------------------------------------------------------------------
// Same thread mapping. The destination of (token slot s, head h, dim d) is
//   block * block_stride + offset * page_stride + h * head_stride + d,
// which covers NHD memory (page_stride = H*D, head_stride = D) and HND memory viewed as NHD
// (page_stride = D, head_stride = B*D) alike. Scales are one number, or one per head.
template <typename scalar_t, KvDtype KV>
__global__ void reshape_and_cache_flash_kernel(
    const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
    typename CacheElement<scalar_t, KV>::type* __restrict__ key_cache,
    typename CacheElement<scalar_t, KV>::type* __restrict__ value_cache,
    const int64_t* __restrict__ slot_mapping,
    int64_t key_stride, int64_t key_head_stride, int64_t value_stride, int64_t value_head_stride,
    int64_t block_stride, int64_t k_page_stride, int64_t k_head_stride, int64_t v_page_stride,
    int64_t v_head_stride, int num_heads, int head_size, int block_size,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, bool per_head_scale) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const int64_t block = slot / block_size;
  const int64_t offset = slot % block_size;
  const int n = num_heads * head_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / head_size;
    const int d = i % head_size;
    float ks = 1.f, vs = 1.f;
    if constexpr (KV != KvDtype::kAuto) {
      ks = k_scale[per_head_scale ? h : 0];
      vs = v_scale[per_head_scale ? h : 0];
    }
    key_cache[block * block_stride + offset * k_page_stride + h * k_head_stride + d] =
        to_cache<scalar_t, KV>(key[token * key_stride + h * key_head_stride + d], ks);
    value_cache[block * block_stride + offset * v_page_stride + h * v_head_stride + d] =
        to_cache<scalar_t, KV>(value[token * value_stride + h * value_head_stride + d], vs);
  }
}

// ------------------------------------------------------------------------------------------------
// copy_blocks: grid (layer, pair); the block's bytes copied in `unit_t` pieces
// ------------------------------------------------------------------------------------------------
template <typename unit_t>
__global__ void copy_blocks_kernel(const int64_t* __restrict__ key_cache_ptrs,
                                   const int64_t* __restrict__ value_cache_ptrs,
                                   const int64_t* __restrict__ block_mapping,   // [num_pairs, 2]
                                   int64_t units_per_block) {
  const int layer = blockIdx.x;
  const int pair = blockIdx.y;
  const int64_t src = block_mapping[2 * pair];
  const int64_t dst = block_mapping[2 * pair + 1];
  unit_t* k = reinterpret_cast<unit_t*>(key_cache_ptrs[layer]);
  unit_t* v = reinterpret_cast<unit_t*>(value_cache_ptrs[layer]);
  for (int64_t i = threadIdx.x; i < units_per_block; i += blockDim.x) {
    k[dst * units_per_block + i] = k[src * units_per_block + i];
    v[dst * units_per_block + i] = v[src * units_per_block + i];
  }
}

// ------------------------------------------------------------------------------------------------
// Host side: dtype dispatch and launches (arguments were checked in Python).
// ------------------------------------------------------------------------------------------------
#define PA_DISPATCH_FLOAT(dtype, scalar_t, ...)                                   \
  [&] {                                                                            \
    if ((dtype) == at::kFloat) { using scalar_t = float; return __VA_ARGS__(); }   \
    if ((dtype) == at::kHalf) { using scalar_t = __half; return __VA_ARGS__(); }   \
    if ((dtype) == at::kBFloat16) { using scalar_t = __nv_bfloat16; return __VA_ARGS__(); } \
    TORCH_CHECK(false, "Unsupported input type of kv cache: ", dtype);             \
  }()

#define PA_DISPATCH_KV(kv, KV, ...)                                                           \
  [&] {                                                                                        \
    if ((kv) == 0) { constexpr KvDtype KV = KvDtype::kAuto; return __VA_ARGS__(); }            \
    if ((kv) == 1) { constexpr KvDtype KV = KvDtype::kFp8E4M3; return __VA_ARGS__(); }         \
    if ((kv) == 2) { constexpr KvDtype KV = KvDtype::kFp8E5M2; return __VA_ARGS__(); }         \
    TORCH_CHECK(false, "Unsupported fp8 kv cache data type code ", kv);                        \
  }()

void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor slot_mapping, int64_t kv_code,
                       torch::Tensor k_scale, torch::Tensor v_scale) {
  const int num_tokens = slot_mapping.size(0);
  if (num_tokens == 0) return;
  const int num_heads = key.size(1), head_size = key.size(2);
  const int block_size = key_cache.size(3), x = key_cache.size(4);
  const c10::cuda::OptionalCUDAGuard guard(device_of(key));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int threads = std::min(num_heads * head_size, 512);
  PA_DISPATCH_FLOAT(key.scalar_type(), scalar_t, [&] {
    PA_DISPATCH_KV(kv_code, KV, [&] {
      using cache_t = typename CacheElement<scalar_t, KV>::type;
      reshape_and_cache_kernel<scalar_t, KV><<<num_tokens, threads, 0, stream>>>(
          reinterpret_cast<const scalar_t*>(key.data_ptr()),
          reinterpret_cast<const scalar_t*>(value.data_ptr()),
          reinterpret_cast<cache_t*>(key_cache.data_ptr()),
          reinterpret_cast<cache_t*>(value_cache.data_ptr()), slot_mapping.data_ptr<int64_t>(),
          key.stride(0), value.stride(0), num_heads, head_size, block_size, x,
          k_scale.data_ptr<float>(), v_scale.data_ptr<float>());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void reshape_and_cache_flash(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor slot_mapping, int64_t kv_code,
                             torch::Tensor k_scale, torch::Tensor v_scale) {
  const int num_tokens = slot_mapping.size(0);   // may be fewer than key's rows (graph padding)
  if (num_tokens == 0) return;
  const int num_heads = key.size(1), head_size = key.size(2);
  const int block_size = key_cache.size(1);
  const c10::cuda::OptionalCUDAGuard guard(device_of(key));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int threads = std::min(num_heads * head_size, 512);
  const bool per_head = k_scale.numel() > 1;
  PA_DISPATCH_FLOAT(key.scalar_type(), scalar_t, [&] {
    PA_DISPATCH_KV(kv_code, KV, [&] {
      using cache_t = typename CacheElement<scalar_t, KV>::type;
      reshape_and_cache_flash_kernel<scalar_t, KV><<<num_tokens, threads, 0, stream>>>(
          reinterpret_cast<const scalar_t*>(key.data_ptr()),
          reinterpret_cast<const scalar_t*>(value.data_ptr()),
          reinterpret_cast<cache_t*>(key_cache.data_ptr()),
          reinterpret_cast<cache_t*>(value_cache.data_ptr()), slot_mapping.data_ptr<int64_t>(),
          key.stride(0), key.stride(1), value.stride(0), value.stride(1), key_cache.stride(0),
          key_cache.stride(1), key_cache.stride(2), value_cache.stride(1), value_cache.stride(2),
          num_heads, head_size, block_size, k_scale.data_ptr<float>(), v_scale.data_ptr<float>(),
          per_head);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// key_cache_ptrs / value_cache_ptrs: int64 device tensors of data pointers, one per layer.
// block_mapping: int64 [num_pairs, 2] on the same device. bytes_per_block: the same for all.
void copy_blocks(torch::Tensor key_cache_ptrs, torch::Tensor value_cache_ptrs,
                 torch::Tensor block_mapping, int64_t bytes_per_block, bool aligned16) {
  const int num_layers = key_cache_ptrs.size(0);
  const int num_pairs = block_mapping.size(0);
  if (num_layers == 0 || num_pairs == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(device_of(block_mapping));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(num_layers, num_pairs);
  // 16-byte pieces when every block starts 16-byte aligned and is a whole number of them.
  if (aligned16) {
    const int64_t units = bytes_per_block / 16;
    copy_blocks_kernel<uint4><<<grid, (int)std::min<int64_t>(units, 1024), 0, stream>>>(
        key_cache_ptrs.data_ptr<int64_t>(), value_cache_ptrs.data_ptr<int64_t>(),
        block_mapping.data_ptr<int64_t>(), units);
  } else {
    copy_blocks_kernel<uint8_t><<<grid, (int)std::min<int64_t>(bytes_per_block, 1024), 0, stream>>>(
        key_cache_ptrs.data_ptr<int64_t>(), value_cache_ptrs.data_ptr<int64_t>(),
        block_mapping.data_ptr<int64_t>(), bytes_per_block);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One cudaMemcpyAsync per (src, dst) pair on the current stream. Blocks are addressed by each
// tensor's own block stride and `block_size_in_bytes` of each are copied. block_mapping: CPU.
void swap_blocks(torch::Tensor src, torch::Tensor dst, int64_t block_size_in_bytes,
                 torch::Tensor block_mapping) {
  const torch::Device gpu = src.is_cuda() ? src.device() : dst.device();
  const c10::cuda::OptionalCUDAGuard guard(gpu);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaMemcpyKind kind;
  if (src.is_cuda() && dst.is_cuda()) kind = cudaMemcpyDeviceToDevice;
  else if (src.is_cuda()) kind = cudaMemcpyDeviceToHost;
  else kind = cudaMemcpyHostToDevice;
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  const int64_t src_stride = src.stride(0) * src.element_size();
  const int64_t dst_stride = dst.stride(0) * dst.element_size();
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_mapping.size(0); ++i) {
    C10_CUDA_CHECK(cudaMemcpyAsync(d + pairs[2 * i + 1] * dst_stride, s + pairs[2 * i] * src_stride,
                                   block_size_in_bytes, kind, stream));
  }
}

}  // namespace paged_attention
