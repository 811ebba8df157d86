// The split-KV combine: merges the per-split partial states a split launch leaves in its workspace
// into out / lse. Instantiated once per dtype here for every attention kernel (mma.sync and wgmma).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../arch/arch.cuh"
#include "attention_launch.h"

namespace mla_kv {
namespace attention_detail {

// Merges the per-split partial states of the workspace into out / lse (more than kFewSplits splits;
// fewer go to combine_few_splits_kernel below). CTA (row, chunk) owns kGroups 64-column groups of
// one (token, head) row; its 8 warps fold disjoint sets of splits (each lane two columns per group),
// then add their sums in shared memory. Many splits (one long sequence) spread a row over up to 8
// CTAs; few splits keep one. The kernel is latency-bound (a few KB per CTA): a warp issues the
// loads of up to kInFlight splits at once, the first of them before the split weights are known,
// so that the lse pass and the partial loads share one memory latency.
constexpr int kCombineWarps = 8;
constexpr int kCombineGroups = kLatentDim / 64;  // 64-column groups of a row

inline int combine_chunks(int num_splits) { return num_splits >= 64 ? 8 : num_splits >= 16 ? 2 : 1; }

template <class T, int kGroups>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_splits_kernel(const AttentionParams p) {
  constexpr int kInFlight = kGroups == 1 ? 16 : 32 / kGroups;  // 32-64 registers of loads
  __shared__ float weight_s[kMaxAttentionSplits];
  __shared__ float2 partial_s[kCombineWarps][kGroups][32];
  __shared__ float max_s[kCombineWarps], sum_s[kCombineWarps];
  arch::wait_for_prior_grid();  // the partials come from the attention grid (CombineLaunch::kEarly)
  const int64_t total_rows = p.total_q_tokens * p.num_heads;
  const int64_t flat = blockIdx.x;
  // Packed tokens past cu_q_lens[batch] belong to no sequence: no split wrote them, and their
  // out/lse rows stay untouched.
  if (p.cu_q_lens != nullptr && flat >= int64_t(p.cu_q_lens[p.batch]) * p.num_heads) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* parts = static_cast<const float*>(p.workspace);
  const float* lses = parts + size_t(p.num_splits) * total_rows * kLatentDim;
  const int col0 = blockIdx.y * kGroups * 64 + lane * 2;

  // Warp w folds splits w, w + kCombineWarps, ...; x holds the kInFlight of them in flight. A split
  // whose kv range was empty wrote no partial: its (weight 0) garbage is loaded but never used.
  float2 x[kInFlight][kGroups];
  auto load = [&](int i0) {
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = i0 + u * kCombineWarps;
      const float* src = parts + (i * total_rows + flat) * kLatentDim + col0;
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
        x[u][g] = i < p.num_splits ? *reinterpret_cast<const float2*>(src + g * 64) : make_float2(0.f, 0.f);
    }
  };
  load(warp);

  float m = -INFINITY;
  for (int i = tid; i < p.num_splits; i += blockDim.x) m = fmaxf(m, lses[i * total_rows + flat]);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  if (lane == 0) max_s[warp] = m;
  __syncthreads();
  m = max_s[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) m = fmaxf(m, max_s[w]);
  float denom = 0.f;
  for (int i = tid; i < p.num_splits; i += blockDim.x) {
    const float wgt = m == -INFINITY ? 0.f : __expf(lses[i * total_rows + flat] - m);
    weight_s[i] = wgt;
    denom += wgt;
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, d);
  if (lane == 0) sum_s[warp] = denom;
  __syncthreads();  // also publishes weight_s
  denom = 0.f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) denom += sum_s[w];

  float2 o[kGroups];
#pragma unroll
  for (int g = 0; g < kGroups; ++g) o[g] = make_float2(0.f, 0.f);
  for (int i0 = warp; i0 < p.num_splits; i0 += kInFlight * kCombineWarps) {
    if (i0 != warp) load(i0);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = i0 + u * kCombineWarps;
      const float wgt = i < p.num_splits ? weight_s[i] : 0.f;
      if (wgt == 0.f) continue;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        o[g].x += wgt * x[u][g].x;
        o[g].y += wgt * x[u][g].y;
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kGroups; ++g) partial_s[warp][g][lane] = o[g];
  __syncthreads();
  const int64_t token = flat / p.num_heads;
  const int h = int(flat - token * p.num_heads);
  int64_t b = 0, t = token;
  if (p.cu_q_lens == nullptr) { b = token / p.q_len; t = token - b * p.q_len; }
  T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + t * p.out_stride_t + int64_t(h) * p.out_stride_h + col0;
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
  for (int g = warp; g < kGroups; g += kCombineWarps) {  // warp g writes 64-column group g
    float2 sum = make_float2(0.f, 0.f);
    for (int w = 0; w < kCombineWarps; ++w) {
      sum.x += partial_s[w][g][lane].x;
      sum.y += partial_s[w][g][lane].y;
    }
    dst[g * 64] = arch::from_float<T>(sum.x * inv);
    dst[g * 64 + 1] = arch::from_float<T>(sum.y * inv);
  }
  if (tid == 0 && blockIdx.y == 0)
    p.lse[b * p.lse_stride_b + t * p.lse_stride_t + int64_t(h) * p.lse_stride_h] =
        denom > 0.f ? m + logf(denom) : -INFINITY;
}

// Few splits (batches that nearly fill the GPU split the KV 2-8 ways): one warp per (token, head)
// row, each lane 16 of its 512 columns as four 16-byte pieces. Split weights travel by warp
// shuffle (lane i holds split i's), so there is no shared memory and no barrier, and a lane keeps
// up to 16 loads in flight (4 splits at a time).
constexpr int kFewSplits = 8;

template <class T>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_few_splits_kernel(const AttentionParams p) {
  arch::wait_for_prior_grid();  // as in combine_splits_kernel
  const int64_t total_rows = p.total_q_tokens * p.num_heads;
  const int lane = threadIdx.x & 31;
  const int64_t flat = int64_t(blockIdx.x) * kCombineWarps + (threadIdx.x >> 5);
  if (flat >= total_rows) return;
  if (p.cu_q_lens != nullptr && flat >= int64_t(p.cu_q_lens[p.batch]) * p.num_heads) return;  // see above
  const float* parts = static_cast<const float*>(p.workspace);
  const float* lses = parts + size_t(p.num_splits) * total_rows * kLatentDim;

  // The first four splits' partials are loaded before the weights are known (one memory latency
  // for both); an empty split's (weight 0) garbage is loaded but never used.
  constexpr int kPieces = kLatentDim / 128;  // float4 pieces per lane: columns 4 lane + 128 g
  float4 x[4][kPieces];
  auto load = [&](int i0) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float* src = parts + ((i0 + u) * total_rows + flat) * kLatentDim + 4 * lane;
#pragma unroll
      for (int g = 0; g < kPieces; ++g)
        x[u][g] = i0 + u < p.num_splits ? *reinterpret_cast<const float4*>(src + 128 * g) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  load(0);
  const float own_lse = lane < p.num_splits ? lses[lane * total_rows + flat] : -INFINITY;
  float m = own_lse;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  const float own_weight = m == -INFINITY ? 0.f : __expf(own_lse - m);
  float denom = own_weight;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, d);

  float4 o[kPieces];
#pragma unroll
  for (int g = 0; g < kPieces; ++g) o[g] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i0 = 0; i0 < p.num_splits; i0 += 4) {
    if (i0 > 0) load(i0);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float wgt = i0 + u < p.num_splits ? __shfl_sync(0xffffffffu, own_weight, (i0 + u) & 31) : 0.f;
      if (wgt == 0.f) continue;  // (the same for every lane)
#pragma unroll
      for (int g = 0; g < kPieces; ++g) {
        o[g].x += wgt * x[u][g].x;
        o[g].y += wgt * x[u][g].y;
        o[g].z += wgt * x[u][g].z;
        o[g].w += wgt * x[u][g].w;
      }
    }
  }
  const int64_t token = flat / p.num_heads;
  const int h = int(flat - token * p.num_heads);
  int64_t b = 0, t = token;
  if (p.cu_q_lens == nullptr) { b = token / p.q_len; t = token - b * p.q_len; }
  T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + t * p.out_stride_t + int64_t(h) * p.out_stride_h + 4 * lane;
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
#pragma unroll
  for (int g = 0; g < kPieces; ++g) {
    arch::Vec<T, 4> v;
    v.v[0] = arch::from_float<T>(o[g].x * inv);
    v.v[1] = arch::from_float<T>(o[g].y * inv);
    v.v[2] = arch::from_float<T>(o[g].z * inv);
    v.v[3] = arch::from_float<T>(o[g].w * inv);
    arch::store<T, 4>(dst + 128 * g, v);
  }
  if (lane == 0)
    p.lse[b * p.lse_stride_b + t * p.lse_stride_t + int64_t(h) * p.lse_stride_h] =
        denom > 0.f ? m + logf(denom) : -INFINITY;
}

// One combine kernel's launch, in stream order or as a programmatic dependent launch.
template <class Kernel>
Status launch_combine_kernel(Kernel kernel, dim3 grid, const AttentionParams& p, CombineLaunch when, cudaStream_t stream) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kCombineWarps * 32);
  config.stream = stream;
  cudaLaunchAttribute early{};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &early;
  config.numAttrs = when == CombineLaunch::kEarly ? 1 : 0;
  if (cudaLaunchKernelEx(&config, kernel, p) != cudaSuccess) return Status::kCudaError;
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

// Merges the splits of a launch (nothing to do for one split).
template <class T>
Status launch_combine(const AttentionParams& p, CombineLaunch when, cudaStream_t stream) {
  if (p.num_splits == 1) return Status::kOk;  // (dispatch checked 1 <= num_splits <= kMaxAttentionSplits)
  const int64_t rows_total = p.total_q_tokens * p.num_heads;
  if (p.num_splits <= kFewSplits)
    return launch_combine_kernel(combine_few_splits_kernel<T>, dim3(unsigned((rows_total + kCombineWarps - 1) / kCombineWarps)),
                                 p, when, stream);
  const int chunks = combine_chunks(p.num_splits);
  const dim3 grid(unsigned(rows_total), chunks);
  if (chunks == 8) return launch_combine_kernel(combine_splits_kernel<T, kCombineGroups / 8>, grid, p, when, stream);
  if (chunks == 2) return launch_combine_kernel(combine_splits_kernel<T, kCombineGroups / 2>, grid, p, when, stream);
  return launch_combine_kernel(combine_splits_kernel<T, kCombineGroups>, grid, p, when, stream);
}

template Status launch_combine<__half>(const AttentionParams&, CombineLaunch, cudaStream_t);
template Status launch_combine<__nv_bfloat16>(const AttentionParams&, CombineLaunch, cudaStream_t);

}  // namespace attention_detail
}  // namespace mla_kv
