// Expanded-form attention (per-head K and V, MLA's head dims) on mma.sync tensor cores: the Sm70 and
// Sm75 tags, for the GPUs without a flash kernel for these dims. A CTA owns block_m query tokens of
// one (sequence, head); each tile of 32 keys is read from memory once into shared memory, K and V
// side by side, and serves all block_m queries.
//
// Per tile: S = Q.K^T on tensor cores (8 warps, each one or two 16 x 16 score tiles over a slice of
// d_qk, expanded_tiles.h) -> online softmax in fp32 (log2 domain; threads that share a row hold
// consecutive columns) -> P in fp16 -> O += P.V, warp w owning columns [w d_v / 8, (w + 1) d_v / 8)
// of every row. The next tile is staged in registers while this one is computed (neither Volta nor
// Turing has cp.async).
// Reference: python/mla_kv/reference/expanded.py (expanded_attention).
#pragma once

#include "../arch/mma.cuh"
#include "../attention/common.cuh"
#include "expanded_tiles.h"
#include "mla_kv/expanded.h"

namespace mla_kv {
namespace expanded_detail {

using attention_detail::accumulate_pv;
using attention_detail::kLn2;
using attention_detail::kLog2e;
using attention_detail::online_softmax_tile;
using attention_detail::qk_partial_scores;
using attention_detail::ScoreTiles;

// The rows a CTA owns: query tokens [row0, row0 + rows) of sequence b, head h, and the keys
// [0, kv_hi) they can see.
struct ExpandedWork {
  int b, h, row0, rows, q_len, k_len, kv_hi;
  int64_t q_base, k_base;  // flat q / k row of the sequence's first token
};

template <int kBlockM>
__device__ __forceinline__ bool find_expanded_work(const ExpandedAttentionParams& p, ExpandedWork& w) {
  // Row blocks vary fastest, so the CTAs resident together are mostly one head's, reading the same
  // K / V tiles (shared in L2: a CTA does only 64 FLOPs per byte it reads, which a V100's HBM alone
  // cannot feed at full tensor rate). Last query rows first: under the causal mask they see the most
  // keys, and the longest CTAs started first stay out of the grid's tail.
  w.row0 = (gridDim.x - 1 - blockIdx.x) * kBlockM;
  w.h = blockIdx.y;
  w.b = blockIdx.z;
  w.q_base = p.cu_q_lens[w.b];
  w.q_len = p.cu_q_lens[w.b + 1] - p.cu_q_lens[w.b];
  if (w.row0 >= min(w.q_len, p.max_q_len)) return false;
  w.k_base = p.cu_k_lens[w.b];
  w.k_len = p.cu_k_lens[w.b + 1] - p.cu_k_lens[w.b];
  w.rows = min(kBlockM, min(w.q_len, p.max_q_len) - w.row0);
  w.kv_hi = p.causal ? max(0, min(w.k_len, w.k_len - w.q_len + w.row0 + w.rows)) : w.k_len;
  return true;
}

template <class A, int kDqk, int kDv, int kBlockM>
__global__ void __launch_bounds__(kThreads, 1) expanded_attention_kernel(const ExpandedAttentionParams p) {
  if constexpr (arch::target_supports<A>()) {
    using T = __half;
    using Mma = arch::WarpMma16<A, T>;
    constexpr ExpandedShape kShape = shape_for(A::kArch, kDqk, kDv, kBlockM);
    constexpr ExpandedSmem L = expanded_smem(kShape);
    constexpr int kQkPitch = kDqk + kPad, kVPitch = kDv + kPad, kScorePitch = score_pitch(), kProbPitch = prob_pitch();
    constexpr int kSplitK = split_k(kShape), kKSlice = kDqk / kSplitK, kQkTilesN = kShape.qk_tiles_n;
    constexpr int kTilesM = kBlockM / 16;
    extern __shared__ __align__(16) unsigned char smem[];
    T* q_s = reinterpret_cast<T*>(smem);
    T* k_s = reinterpret_cast<T*>(smem + L.q);
    T* v_s = reinterpret_cast<T*>(smem + L.q + L.k);
    float* score_s = reinterpret_cast<float*>(smem + L.q + L.k + L.v);
    T* prob_s = reinterpret_cast<T*>(smem + L.q + L.k + L.v + L.scores);
    float* alpha_s = reinterpret_cast<float*>(smem + L.q + L.k + L.v + L.scores + L.probs);
    float* max_s = alpha_s + kBlockM;
    float* sum_s = max_s + kBlockM;

    ExpandedWork w;
    if (!find_expanded_work<kBlockM>(p, w)) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const T* q = static_cast<const T*>(p.q) + w.q_base * p.q_stride_t + int64_t(w.h) * p.q_stride_h;
    const T* k = static_cast<const T*>(p.k) + w.k_base * p.k_stride_t + int64_t(w.h) * p.k_stride_h;
    const T* v = static_cast<const T*>(p.v) + w.k_base * p.v_stride_t + int64_t(w.h) * p.v_stride_h;

    // Q rows -> smem at their A-operand rows (mma.cuh), zero rows past the CTA's last query.
    constexpr int kQkVecs = kDqk / 8, kVVecs = kDv / 8;
    for (int i = tid; i < kBlockM * kQkVecs; i += kThreads) {
      const int r = i / kQkVecs, c = (i - r * kQkVecs) * 8;
      int4 x = make_int4(0, 0, 0, 0);
      if (r < w.rows) x = *reinterpret_cast<const int4*>(q + int64_t(w.row0 + r) * p.q_stride_t + c);
      *reinterpret_cast<int4*>(q_s + Mma::a_row(r) * kQkPitch + c) = x;
    }

    // Tile loads: thread tid moves 16-byte vectors tid, tid + 256, ... of the tile's K rows, then its
    // V rows; keys past kv_hi are zero (a masked key's P is 0, and 0 x V must stay 0).
    constexpr int kTileVecs = kBlockN * (kQkVecs + kVVecs);
    constexpr int kLoads = (kTileVecs + kThreads - 1) / kThreads;
    int4 staged[kLoads];
    auto issue = [&](int j0) MLA_KV_INLINE_LAMBDA {
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int e = tid + i * kThreads;
        staged[i] = make_int4(0, 0, 0, 0);
        if (e >= kTileVecs) continue;
        const bool is_k = e < kBlockN * kQkVecs;
        const int f = is_k ? e : e - kBlockN * kQkVecs, per_row = is_k ? kQkVecs : kVVecs;
        const int r = f / per_row, c = (f - r * per_row) * 8;
        if (j0 + r >= w.kv_hi) continue;
        const T* src = is_k ? k + int64_t(j0 + r) * p.k_stride_t + c : v + int64_t(j0 + r) * p.v_stride_t + c;
        const arch::Vec<T, 8> x = arch::load_stream<A, T, 8>(src);
        staged[i] = *reinterpret_cast<const int4*>(&x);
      }
    };
    auto stash = [&]() MLA_KV_INLINE_LAMBDA {
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int e = tid + i * kThreads;
        if (e >= kTileVecs) continue;
        const bool is_k = e < kBlockN * kQkVecs;
        const int f = is_k ? e : e - kBlockN * kQkVecs, per_row = is_k ? kQkVecs : kVVecs;
        const int r = f / per_row, c = (f - r * per_row) * 8;
        *reinterpret_cast<int4*>(is_k ? k_s + r * kQkPitch + c : v_s + r * kVPitch + c) = staged[i];
      }
    };

    // Softmax ownership: consecutive threads (one warp's lanes) share a row (common.cuh ScoreTiles).
    using Scores = ScoreTiles<kThreads, kBlockM, kBlockN, kSplitK, kScorePitch, kProbPitch>;
    const int my_row = Scores::row_of(tid), my_col0 = Scores::col0_of(tid);
    int row_limit = -1;  // keys < row_limit are visible to my row
    if (my_row < w.rows)
      row_limit = p.causal ? min(w.kv_hi, w.k_len - w.q_len + w.row0 + my_row + 1) : w.kv_hi;
    float row_max = -INFINITY, row_sum = 0.f;
    const float scale_log2 = p.softmax_scale * kLog2e;

    constexpr int kTilesN = kDv / kWarps / 16;
    const int col0 = warp * (kDv / kWarps);
    float acc[kTilesM][kTilesN][8];
#pragma unroll
    for (int mt = 0; mt < kTilesM; ++mt)
#pragma unroll
      for (int nt = 0; nt < kTilesN; ++nt)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[mt][nt][i] = 0.f;

    // This warp's score tiles and its slice of the d_qk contraction.
    constexpr int kGroupsN = kBlockN / 16 / kQkTilesN;
    const int group = warp % score_groups(kShape), ks = warp / score_groups(kShape);
    const int st_m = (group / kGroupsN) * 16, st_n = (group % kGroupsN) * 16 * kQkTilesN;

    issue(0);
    for (int j0 = 0; j0 < w.kv_hi; j0 += kBlockN) {
      stash();
      __syncthreads();  // this tile (and, first time, Q) visible to every warp
      if (j0 + kBlockN < w.kv_hi) issue(j0 + kBlockN);

      {  // S partial over this warp's slice (common.cuh), one row of score tiles. The slices are 16-byte
         // aligned (pitches and slices are multiples of 8 elements): said, so that the fragment loads of one
         // row merge into 16-byte ones.
        const T* q_slice = static_cast<const T*>(__builtin_assume_aligned(q_s + st_m * kQkPitch + ks * kKSlice, 16));
        const T* k_slice = static_cast<const T*>(__builtin_assume_aligned(k_s + st_n * kQkPitch + ks * kKSlice, 16));
        qk_partial_scores<Mma, 1, kQkTilesN, kKSlice, kQkPitch, kScorePitch>(
            q_slice, k_slice, score_s + ks * kBlockM * kScorePitch, st_m, st_n, lane);
      }
      __syncthreads();

      // Online softmax of my row's columns (every key row exists: valid ~0u), then O = O * alpha + P.V
      // (common.cuh).
      const bool rescale = online_softmax_tile<Scores, Mma, false>(
          score_s, prob_s, alpha_s, my_row, my_col0, scale_log2, j0, row_limit, ~0u, row_max, row_sum);
      accumulate_pv<Scores, Mma, kVPitch>(acc, rescale, alpha_s, prob_s, v_s, col0, lane);
      __syncthreads();  // K, V and P are rewritten next
    }

    // Epilogue: normalize and write out / lse of the CTA's rows (0 / -inf for a row with no key).
    if (my_col0 == 0) {
      max_s[my_row] = row_max;
      sum_s[my_row] = row_sum;
    }
    __syncthreads();
    T* out = static_cast<T*>(p.out) + w.q_base * p.out_stride_t + int64_t(w.h) * p.out_stride_h;
#pragma unroll
    for (int mt = 0; mt < kTilesM; ++mt)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int r = mt * 16 + Mma::acc_row(lane, i);
        if (r >= w.rows) continue;
        const float l = sum_s[r], inv = l > 0.f ? 1.f / l : 0.f;
        T* dst = out + int64_t(w.row0 + r) * p.out_stride_t + col0;
#pragma unroll
        for (int nt = 0; nt < kTilesN; ++nt) dst[nt * 16 + Mma::acc_col(lane, i)] = arch::from_float<T>(acc[mt][nt][i] * inv);
      }
    if (p.lse != nullptr && tid < w.rows) {
      const float l = sum_s[tid];
      p.lse[(w.q_base + w.row0 + tid) * p.lse_stride_t + int64_t(w.h) * p.lse_stride_h] =
          l > 0.f ? (max_s[tid] + log2f(l)) * kLn2 : -INFINITY;
    }
  } else {
    __trap();  // the host never launches a tag the compiled target cannot run
  }
}

template <class A, int kDqk, int kDv, int kBlockM>
Status launch_shape(const ExpandedAttentionParams& p, cudaStream_t stream) {
  const auto kernel = expanded_attention_kernel<A, kDqk, kDv, kBlockM>;
  constexpr size_t smem = expanded_smem(shape_for(A::kArch, kDqk, kDv, kBlockM)).total();
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
    return Status::kCudaError;
  const dim3 grid((p.max_q_len + kBlockM - 1) / kBlockM, p.num_heads, p.batch);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

// Tag A at head dims (kDqk, kDv), block_m rows per CTA (expanded_attention_tiles chose it).
template <class A, int kDqk, int kDv>
Status launch_expanded(const ExpandedAttentionParams& p, int block_m, cudaStream_t stream) {
  static_assert(shapes_fit_their_gpus<A::kArch, kDqk, kDv>(), "an expanded tile exceeds the GPU its tag serves");
  if (block_m == 64) {
    if constexpr (block_m_for(A::kArch, kDqk, kDv) == 64) return launch_shape<A, kDqk, kDv, 64>(p, stream);
    return Status::kInvalidArgument;
  }
  return block_m == 32 ? launch_shape<A, kDqk, kDv, 32>(p, stream) : Status::kSharedMemoryExceeded;
}

}  // namespace expanded_detail
}  // namespace mla_kv

// The supported head dims of tag A, one .cu per tag.
#define MLA_KV_INSTANTIATE_EXPANDED(A)                                                                          \
  template mla_kv::Status mla_kv::expanded_detail::launch_expanded<A, 192, 128>(                                \
      const mla_kv::ExpandedAttentionParams&, int, cudaStream_t);                                              \
  template mla_kv::Status mla_kv::expanded_detail::launch_expanded<A, 256, 256>(                                \
      const mla_kv::ExpandedAttentionParams&, int, cudaStream_t);                                              \
  template mla_kv::Status mla_kv::expanded_detail::launch_expanded<A, 128, 128>(                                \
      const mla_kv::ExpandedAttentionParams&, int, cudaStream_t);
