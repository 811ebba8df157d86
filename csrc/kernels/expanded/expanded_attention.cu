// invokeExpandedAttention: argument checks, tag and tile choice, dispatch by head dims.
#include <cstdint>
#include <initializer_list>

#include "../arch/arch.cuh"
#include "expanded_tiles.h"
#include "mla_kv/expanded.h"

namespace mla_kv {
namespace expanded_detail {
template <class A, int kDqk, int kDv>
Status launch_expanded(const ExpandedAttentionParams& p, int block_m, cudaStream_t stream);
}  // namespace expanded_detail

namespace {

bool dims_supported(int d_qk, int d_v) {
  return (d_qk == 192 && d_v == 128) || (d_qk == 256 && d_v == 256) || (d_qk == 128 && d_v == 128);
}

template <class A>
Status launch_dims(const ExpandedAttentionParams& p, int block_m, cudaStream_t stream) {
  using expanded_detail::launch_expanded;
  if (p.head_dim_qk == 192) return launch_expanded<A, 192, 128>(p, block_m, stream);
  if (p.head_dim_qk == 256) return launch_expanded<A, 256, 256>(p, block_m, stream);
  return launch_expanded<A, 128, 128>(p, block_m, stream);
}

bool aligned(const void* ptr, std::initializer_list<int64_t> strides) {
  bool ok = reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  for (int64_t s : strides) ok = ok && s % 8 == 0;
  return ok;
}

}  // namespace

bool expanded_attention_supported(Arch tag, int head_dim_qk, int head_dim_v, DType dtype) {
  return (tag == Arch::kSm70 || tag == Arch::kSm75) && dtype == DType::kFloat16 &&
         dims_supported(head_dim_qk, head_dim_v);
}

ExpandedTiles expanded_attention_tiles(Arch tag, int head_dim_qk, int head_dim_v, SmemLimits limits) {
  using namespace expanded_detail;
  if (!expanded_attention_supported(tag, head_dim_qk, head_dim_v, DType::kFloat16)) return {};
  const SmemLimits l = effective_smem_limits(limits);
  for (int block_m = block_m_for(tag, head_dim_qk, head_dim_v); block_m >= 32; block_m /= 2) {
    const int bytes = int(expanded_smem(shape_for(tag, head_dim_qk, head_dim_v, block_m)).total());
    if (bytes <= l.per_block && bytes + l.reserved_per_block <= l.per_sm) return {block_m, kBlockN, bytes};
  }
  return {};
}

Status invokeExpandedAttention(const ExpandedAttentionParams& p, Arch arch, cudaStream_t stream) {
  if (p.dtype != DType::kFloat16) return Status::kUnsupportedDType;
  // The arguments first (no device needed to refuse them), then the variant the device runs.
  if (!dims_supported(p.head_dim_qk, p.head_dim_v) || p.batch < 0 || p.num_heads < 0 || p.max_q_len < 0 ||
      p.batch > 65535 || p.num_heads > 65535)
    return Status::kInvalidArgument;
  if (p.batch == 0 || p.num_heads == 0 || p.max_q_len == 0) return Status::kOk;
  if (p.cu_q_lens == nullptr || p.cu_k_lens == nullptr || p.q == nullptr || p.k == nullptr || p.v == nullptr ||
      p.out == nullptr || !aligned(p.q, {p.q_stride_t, p.q_stride_h}) || !aligned(p.k, {p.k_stride_t, p.k_stride_h}) ||
      !aligned(p.v, {p.v_stride_t, p.v_stride_h}) || !aligned(p.out, {p.out_stride_t, p.out_stride_h}))
    return Status::kInvalidArgument;
  const int cc = device_compute_capability();
  // Auto: the Sm75 kernel wherever it runs (its m16n8k8 is native from Turing up), else Sm70.
  Arch tag = resolve_arch(arch == Arch::kAuto ? Arch::kSm75 : arch, cc);
  if (tag == Arch::kAuto && arch == Arch::kAuto) tag = resolve_arch(Arch::kSm70, cc);
  if (tag != Arch::kSm70 && tag != Arch::kSm75) return Status::kUnsupportedArch;
  const ExpandedTiles tiles = expanded_attention_tiles(tag, p.head_dim_qk, p.head_dim_v, p.smem_limits);
  if (tiles.block_m == 0) return Status::kSharedMemoryExceeded;
  return tag == Arch::kSm70 ? launch_dims<arch::Sm70>(p, tiles.block_m, stream)
                            : launch_dims<arch::Sm75>(p, tiles.block_m, stream);
}

}  // namespace mla_kv
