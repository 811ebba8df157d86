// The gather of a quantized cache: out row t = the dequantized cache row of the same position as in
// gather_kv.cuh, latent first, in the 16-bit out dtype. The expanded-route prefill feeds it to
// kv_b_proj, so it must equal mla_kv.reference.gather_kv(kv_format=...) bit for bit (dequant.cuh
// computes every value as the reference does).
//
// One warp per out row (gather_row). The lookup of the row (log2(batch) loads) is done by every lane: the same
// addresses, one transaction.
#pragma once

#include <cstdint>

#include "../address.cuh"
#include "../arch/arch.cuh"
#include "../dequant.cuh"
#include "gather_kv.cuh"

namespace mla_kv {
namespace gather_detail {

constexpr int kDequantWarpsPerBlock = 8;

// Lane l's share of one row: the 8 latent values at (i * 32 + l) * 8 (i = 0, 1) and, lanes < 8, the
// 8 rope values at l * 8, each vector 8 bytes (fp8, int8), 4 (int4) or 16 (fp8_ds_mla's bf16 rope) in
// and 16 out.
template <class A, KvFormat F, class T, class Rows>
__device__ __forceinline__ void gather_row(const Rows& rows, const char* base, int pos, const char* row, int lane, T* out) {
  const RowLayout& layout = rows.cache.row;
  float scale = layout.kv_scale, zero = 0.f;
  if constexpr (F == KvFormat::kInt8 || F == KvFormat::kInt4) {
    const float2 sz = dequant::scale_zero<T>(__ldg(reinterpret_cast<const unsigned*>(trailer_pair(rows, base, pos))));
    scale = sz.x;
    zero = sz.y;
  }
  float v[8];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = layout.latent_offset + (i * 32 + lane) * 8;
    if constexpr (F == KvFormat::kFp8DsMla) scale = dequant::ds_tile_scale(row, e);
    dequant::values8<A, F>(dequant::load8<F>(row, e), false, scale, zero, v);
    arch::store<T, 8>(out + (i * 32 + lane) * 8, dequant::to_vec<T>(v));
  }
  if (lane < 8) {
    const int e = layout.rope_offset + lane * 8;
    dequant::values8<A, F>(dequant::load8<F>(row, e), true, scale, zero, v);  // (fp8_ds_mla's rope: none)
    arch::store<T, 8>(out + kLatentDim + lane * 8, dequant::to_vec<T>(v));
  }
}

template <class A, class T, class Rows>
__global__ void __launch_bounds__(kDequantWarpsPerBlock * 32)
    gather_kv_dequant_kernel(const GatherKvParams p, const Rows rows) {
  if constexpr (arch::target_supports<A>()) {
    const int lane = threadIdx.x & 31;
    const int64_t t = int64_t(blockIdx.x) * kDequantWarpsPerBlock + (threadIdx.x >> 5);
    if (t >= p.out_rows || t >= p.cu_kv_lens[p.batch]) return;
    const int b = sequence_of(p.cu_kv_lens, p.batch, t);
    const int64_t pos = (p.starts ? p.starts[b] : 0) + (t - p.cu_kv_lens[b]);
    if (pos < 0 || pos > INT_MAX) return;
    const char* base = rows.block_base(b, int(pos));
    if (base == nullptr) return;
    const RowLayout& layout = rows.cache.row;
    const char* row = rows.row_in_block(base, int(pos));
    T* out = static_cast<T*>(p.out) + t * p.out_stride;
    switch (layout.format) {
      case KvFormat::kFp8: gather_row<A, KvFormat::kFp8, T>(rows, base, int(pos), row, lane, out); break;
      case KvFormat::kFp8DsMla: gather_row<A, KvFormat::kFp8DsMla, T>(rows, base, int(pos), row, lane, out); break;
      case KvFormat::kInt8: gather_row<A, KvFormat::kInt8, T>(rows, base, int(pos), row, lane, out); break;
      case KvFormat::kInt4: gather_row<A, KvFormat::kInt4, T>(rows, base, int(pos), row, lane, out); break;
      default: break;  // kNone takes the copy kernel
    }
  } else {
    __trap();  // the host never launches a tag the compiled target cannot run
  }
}

template <class A, class T, class Rows>
Status launch_gather_kv_dequant(const GatherKvParams& p, const Rows& rows, cudaStream_t stream) {
  if (p.out_rows <= 0 || p.batch <= 0) return Status::kOk;
  const dim3 grid(unsigned((p.out_rows + kDequantWarpsPerBlock - 1) / kDequantWarpsPerBlock));
  gather_kv_dequant_kernel<A, T, Rows><<<grid, kDequantWarpsPerBlock * 32, 0, stream>>>(p, rows);
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

}  // namespace gather_detail
}  // namespace mla_kv
