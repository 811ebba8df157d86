// The gather of a quantized cache: out row t = the dequantized cache row of the same position as in
// gather_kv.cuh, latent first, in the 16-bit out dtype. The expanded-route prefill feeds it to
// kv_b_proj, so it must equal mla_kv.reference.gather_kv(kv_format=...) bit for bit: every value
// is computed in fp32 as the reference computes it (an e4m3 value times its scale; an int code times
// the row's scale, then plus its zero, two roundings: no fused multiply-add), then rounded once to T.
//
// One warp per out row: lane l holds the 8 consecutive latent values at (i * 32 + l) * 8 (i = 0, 1)
// and, on lanes < 8, the 8 rope values at l * 8; each lane reads 8 bytes (fp8, int8) or 4 (int4) per
// vector and writes 16. The lookup of the row (log2(batch) loads) is done by every lane: the same
// addresses, one transaction.
#pragma once

#include <cstdint>

#include "../address.cuh"
#include "../arch/arch.cuh"
#include "../arch/fp8.cuh"
#include "gather_kv.cuh"

namespace mla_kv {
namespace gather_detail {

constexpr int kDequantWarpsPerBlock = 8;

template <class T>
__device__ __forceinline__ arch::Vec<T, 8> to_vec(const float (&v)[8]) {
  arch::Vec<T, 8> r;
#pragma unroll
  for (int k = 0; k < 8; ++k) r.v[k] = arch::from_float<T>(v[k]);
  return r;
}

// 8 e4m3 bytes (lo: values 0..3) times scale.
__device__ __forceinline__ void fp8_values(uint2 bytes, float scale, float (&v)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = __fmul_rn(arch::e4m3_to_float(((k < 4 ? bytes.x : bytes.y) >> (8 * (k & 3))) & 0xFFu), scale);
}

// 8 codes times scale plus zero: int8 bytes, or one int4 word whose nibbles from the low one up hold
// values 0, 2, 4, 6, 1, 3, 5, 7.
__device__ __forceinline__ void int_values(const char* p, bool int4, float scale, float zero, float (&v)[8]) {
  uint32_t c[8];
  if (int4) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
#pragma unroll
    for (int n = 0; n < 8; ++n) c[(n & 3) * 2 + (n >> 2)] = (w >> (4 * n)) & 0xFu;
  } else {
    const uint2 b = *reinterpret_cast<const uint2*>(p);
#pragma unroll
    for (int k = 0; k < 8; ++k) c[k] = ((k < 4 ? b.x : b.y) >> (8 * (k & 3))) & 0xFFu;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = __fadd_rn(__fmul_rn(float(c[k]), scale), zero);
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
    const bool has_pe = lane < 8;
    float lat[2][8], pe[8];

    switch (layout.format) {
      case KvFormat::kFp8:
#pragma unroll
        for (int i = 0; i < 2; ++i)
          fp8_values(*reinterpret_cast<const uint2*>(row + layout.latent_offset + (i * 32 + lane) * 8), layout.kv_scale,
                     lat[i]);
        if (has_pe) fp8_values(*reinterpret_cast<const uint2*>(row + layout.rope_offset + lane * 8), layout.kv_scale, pe);
        break;
      case KvFormat::kFp8DsMla: {  // latent first: 4 tiles of 128 e4m3 values, their fp32 scales, bf16 rope
        const float* scales = reinterpret_cast<const float*>(row + kLatentDim);
#pragma unroll
        for (int i = 0; i < 2; ++i)
          fp8_values(*reinterpret_cast<const uint2*>(row + (i * 32 + lane) * 8), scales[2 * i + lane / 16], lat[i]);
        if (has_pe) {
          const arch::Vec<__nv_bfloat16, 8> r =
              arch::load_stream<A, __nv_bfloat16, 8>(reinterpret_cast<const __nv_bfloat16*>(row + kLatentDim + 16) + lane * 8);
#pragma unroll
          for (int k = 0; k < 8; ++k) pe[k] = arch::to_float(r.v[k]);
        }
        break;
      }
      case KvFormat::kInt8:
      case KvFormat::kInt4: {
        const bool int4 = layout.format == KvFormat::kInt4;
        const T* pair = reinterpret_cast<const T*>(trailer_pair(rows, base, int(pos)));
        const float scale = arch::to_float(pair[0]), zero = arch::to_float(pair[1]);
        const int shift = int4 ? 1 : 0;  // bytes per value: 1 or 1/2
#pragma unroll
        for (int i = 0; i < 2; ++i)
          int_values(row + ((layout.latent_offset + (i * 32 + lane) * 8) >> shift), int4, scale, zero, lat[i]);
        if (has_pe) int_values(row + ((layout.rope_offset + lane * 8) >> shift), int4, scale, zero, pe);
        break;
      }
      default:
        return;  // kNone takes the copy kernel
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) arch::store<T, 8>(out + (i * 32 + lane) * 8, to_vec<T>(lat[i]));
    if (has_pe) arch::store<T, 8>(out + kLatentDim + lane * 8, to_vec<T>(pe));
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
