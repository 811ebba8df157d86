// The split-KV combine: merges the per-split partial states a split launch leaves in its workspace
// into out / lse. Instantiated once per dtype here for every attention kernel (mma.sync and wgmma).
#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../arch/arch.cuh"
#include "attention_launch.h"
#include "plan.h"

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

// One (token, head) row's partial states: split i's 512 floats at part + i * part_stride, its lse at
// lse[i * lse_stride]; and where the merged row goes.
template <class T>
struct CombineRow {
  const float* part;
  int64_t part_stride;
  const float* lse;
  int64_t lse_stride;
  int splits;
  T* out;         // the row's 512 outputs
  float* out_lse;
};

// The out / lse row of sequence b's token t (uniform; packed: global token t, b unused), head h.
template <class T>
__device__ __forceinline__ CombineRow<T> out_row(const AttentionParams& p, int64_t b, int64_t t, int64_t h) {
  CombineRow<T> r{};
  r.out = static_cast<T*>(p.out) + b * p.out_stride_b + t * p.out_stride_t + h * p.out_stride_h;
  r.out_lse = p.lse + b * p.lse_stride_b + t * p.lse_stride_t + h * p.lse_stride_h;
  return r;
}

// The uniform split's rows: [split][flat row], flat = global token * H + h.
template <class T>
__device__ __forceinline__ CombineRow<T> uniform_split_row(const AttentionParams& p, int64_t flat) {
  const int64_t total_rows = p.total_q_tokens * p.num_heads;
  const int64_t token = flat / p.num_heads, h = flat - token * p.num_heads;
  const int64_t b = p.cu_q_lens == nullptr ? token / p.q_len : 0;
  CombineRow<T> r = out_row<T>(p, b, token - b * p.q_len, h);
  const float* parts = static_cast<const float*>(p.workspace);
  r.part = parts + flat * kLatentDim;
  r.part_stride = total_rows * kLatentDim;
  r.lse = parts + size_t(p.num_splits) * total_rows * kLatentDim + flat;
  r.lse_stride = total_rows;
  r.splits = p.num_splits;
  return r;
}

// A plan's rows: entry unit * 64 + r of a combine list is row r of split unit `unit`, whose splits
// are slots slot0 .. of block_m rows each.
template <class T>
__device__ __forceinline__ CombineRow<T> planned_row(const AttentionParams& p, const PlanView& plan, int entry) {
  const PlanUnit u = plan.units[entry >> 6];
  const int r = entry & 63, block_m = p.plan_sizes.block_m;
  const int row = u.row0 + r, s = row / p.num_heads;
  const int64_t b = p.cu_q_lens == nullptr ? u.b : 0, t = p.cu_q_lens == nullptr ? s : p.cu_q_lens[u.b] + s;
  CombineRow<T> c = out_row<T>(p, b, t, row - s * p.num_heads);
  const float* parts = static_cast<const float*>(p.workspace);
  const int64_t first = int64_t(u.slot0) * block_m + r;
  c.part = parts + first * kLatentDim;
  c.part_stride = int64_t(block_m) * kLatentDim;
  c.lse = parts + int64_t(p.plan_sizes.max_slots) * block_m * kLatentDim + first;
  c.lse_stride = block_m;
  c.splits = u.splits;
  return c;
}

// Column chunk `chunk` (kGroups 64-column groups) of one row, merged by the CTA's 8 warps.
template <class T, int kGroups>
__device__ __forceinline__ void combine_row_chunk(const CombineRow<T>& row, int chunk) {
  constexpr int kInFlight = kGroups == 1 ? 16 : 32 / kGroups;  // 32-64 registers of loads
  __shared__ float weight_s[kMaxAttentionSplits];
  __shared__ float2 partial_s[kCombineWarps][kGroups][32];
  __shared__ float max_s[kCombineWarps], sum_s[kCombineWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int col0 = chunk * kGroups * 64 + lane * 2;

  // Warp w folds splits w, w + kCombineWarps, ...; x holds the kInFlight of them in flight. A split
  // whose kv range was empty wrote no partial: its (weight 0) garbage is loaded but never used.
  float2 x[kInFlight][kGroups];
  auto load = [&](int i0) {
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = i0 + u * kCombineWarps;
      const float* src = row.part + i * row.part_stride + col0;
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
        x[u][g] = i < row.splits ? *reinterpret_cast<const float2*>(src + g * 64) : make_float2(0.f, 0.f);
    }
  };
  load(warp);

  float m = -INFINITY;
  for (int i = tid; i < row.splits; i += blockDim.x) m = fmaxf(m, row.lse[i * row.lse_stride]);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  if (lane == 0) max_s[warp] = m;
  __syncthreads();
  m = max_s[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) m = fmaxf(m, max_s[w]);
  float denom = 0.f;
  for (int i = tid; i < row.splits; i += blockDim.x) {
    const float wgt = m == -INFINITY ? 0.f : __expf(row.lse[i * row.lse_stride] - m);
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
  for (int i0 = warp; i0 < row.splits; i0 += kInFlight * kCombineWarps) {
    if (i0 != warp) load(i0);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = i0 + u * kCombineWarps;
      const float wgt = i < row.splits ? weight_s[i] : 0.f;
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
  T* dst = row.out + col0;
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
  if (tid == 0 && chunk == 0) *row.out_lse = denom > 0.f ? m + logf(denom) : -INFINITY;
  __syncthreads();  // shared memory is reused by the CTA's next row
}

template <class T, int kGroups>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_splits_kernel(const AttentionParams p) {
  arch::wait_for_prior_grid();  // the partials come from the attention grid (CombineLaunch::kEarly)
  const int64_t flat = blockIdx.x;
  // Packed tokens past cu_q_lens[batch] belong to no sequence: no split wrote them, and their
  // out/lse rows stay untouched.
  if (p.cu_q_lens != nullptr && flat >= int64_t(p.cu_q_lens[p.batch]) * p.num_heads) return;
  combine_row_chunk<T, kGroups>(uniform_split_row<T>(p, flat), blockIdx.y);
}

// Few splits (batches that nearly fill the GPU split the KV 2-8 ways): one warp per (token, head)
// row, each lane 16 of its 512 columns as four 16-byte pieces. Split weights travel by warp
// shuffle (lane i holds split i's), so there is no shared memory and no barrier, and a lane keeps
// up to 16 loads in flight (4 splits at a time).
constexpr int kFewSplits = 8;

template <class T>
__device__ __forceinline__ void combine_row_warp(const CombineRow<T>& row) {
  const int lane = threadIdx.x & 31;
  // The first four splits' partials are loaded before the weights are known (one memory latency
  // for both); an empty split's (weight 0) garbage is loaded but never used.
  constexpr int kPieces = kLatentDim / 128;  // float4 pieces per lane: columns 4 lane + 128 g
  float4 x[4][kPieces];
  auto load = [&](int i0) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float* src = row.part + (i0 + u) * row.part_stride + 4 * lane;
#pragma unroll
      for (int g = 0; g < kPieces; ++g)
        x[u][g] = i0 + u < row.splits ? *reinterpret_cast<const float4*>(src + 128 * g) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  load(0);
  const float own_lse = lane < row.splits ? row.lse[lane * row.lse_stride] : -INFINITY;
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
  for (int i0 = 0; i0 < row.splits; i0 += 4) {
    if (i0 > 0) load(i0);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float wgt = i0 + u < row.splits ? __shfl_sync(0xffffffffu, own_weight, (i0 + u) & 31) : 0.f;
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
  T* dst = row.out + 4 * lane;
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
  if (lane == 0) *row.out_lse = denom > 0.f ? m + logf(denom) : -INFINITY;
}

template <class T>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_few_splits_kernel(const AttentionParams p) {
  arch::wait_for_prior_grid();  // as in combine_splits_kernel
  const int64_t flat = int64_t(blockIdx.x) * kCombineWarps + (threadIdx.x >> 5);
  if (flat >= p.total_q_tokens * p.num_heads) return;
  if (p.cu_q_lens != nullptr && flat >= int64_t(p.cu_q_lens[p.batch]) * p.num_heads) return;  // see above
  combine_row_warp<T>(uniform_split_row<T>(p, flat));
}

// A plan's combine: its few-split rows (a warp each) on the first kPlanFewCtas CTAs, its many-split
// rows (8 CTAs of 64 columns each) on the rest; both lists' lengths are the plan's, so the grid is
// fixed and each part strides over its list.
constexpr int kPlanFewCtas = 128;

template <class T>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_plan_kernel(const AttentionParams p, int many_ctas) {
  arch::wait_for_prior_grid();  // the partials, and the plan's lists, are the attention grid's inputs and outputs
  const PlanView plan = plan_view(p.plan, p.plan_sizes);
  if (blockIdx.x < kPlanFewCtas) {
    const int rows = plan.header[kPlanFewRows];
    for (int i = blockIdx.x * kCombineWarps + (threadIdx.x >> 5); i < rows; i += kPlanFewCtas * kCombineWarps)
      combine_row_warp<T>(planned_row<T>(p, plan, plan.few_rows[i]));
  } else {
    const int work = plan.header[kPlanManyRows] * kCombineGroups;
    for (int i = blockIdx.x - kPlanFewCtas; i < work; i += many_ctas)
      combine_row_chunk<T, 1>(planned_row<T>(p, plan, plan.many_rows[i / kCombineGroups]), i % kCombineGroups);
  }
}

// One combine kernel's launch, in stream order or as a programmatic dependent launch.
template <class Kernel, class... Args>
Status launch_combine_kernel(Kernel kernel, dim3 grid, CombineLaunch when, cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kCombineWarps * 32);
  config.stream = stream;
  cudaLaunchAttribute early{};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &early;
  config.numAttrs = when == CombineLaunch::kEarly ? 1 : 0;
  if (cudaLaunchKernelEx(&config, kernel, args...) != cudaSuccess) return Status::kCudaError;
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

// Merges the splits of a launch (nothing to do for one split).
template <class T>
Status launch_combine(const AttentionParams& p, CombineLaunch when, cudaStream_t stream) {
  if (p.plan != nullptr) {
    // Many-split rows: one long sequence's 16-64 rows x 8 chunks fill a few hundred CTAs.
    const int many_ctas = std::max(1, std::min(p.plan_sizes.max_rows * kCombineGroups, 512));
    return launch_combine_kernel(combine_plan_kernel<T>, dim3(unsigned(kPlanFewCtas + many_ctas)), when, stream, p,
                                 many_ctas);
  }
  if (p.num_splits == 1) return Status::kOk;  // (dispatch checked 1 <= num_splits <= kMaxAttentionSplits)
  const int64_t rows_total = p.total_q_tokens * p.num_heads;
  if (p.num_splits <= kFewSplits)
    return launch_combine_kernel(combine_few_splits_kernel<T>, dim3(unsigned((rows_total + kCombineWarps - 1) / kCombineWarps)),
                                 when, stream, p);
  const int chunks = combine_chunks(p.num_splits);
  const dim3 grid(unsigned(rows_total), chunks);
  if (chunks == 8) return launch_combine_kernel(combine_splits_kernel<T, kCombineGroups / 8>, grid, when, stream, p);
  if (chunks == 2) return launch_combine_kernel(combine_splits_kernel<T, kCombineGroups / 2>, grid, when, stream, p);
  return launch_combine_kernel(combine_splits_kernel<T, kCombineGroups>, grid, when, stream, p);
}

template Status launch_combine<__half>(const AttentionParams&, CombineLaunch, cudaStream_t);
template Status launch_combine<__nv_bfloat16>(const AttentionParams&, CombineLaunch, cudaStream_t);

}  // namespace attention_detail
}  // namespace mla_kv
