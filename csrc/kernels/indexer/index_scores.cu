// invokeIndexScores: checks the arguments, picks the arch tag's variant and the positions per CTA.
#include <algorithm>
#include <cstdint>

#include "../arch/arch.cuh"
#include "index_scores_launch.h"

namespace mla_kv {
namespace {

// Positions per CTA, in 64-position tiles: few enough that the grid fills the GPU about four CTAs per
// SM twice over, at least 4 tiles (a CTA's q prologue then costs at most a quarter of its key reads).
int tiles_per_cta(const IndexScoresParams& p, int sm_count) {
  const int64_t tokens_per_cta = 64 / p.heads;
  const int64_t groups = (p.max_q_len + tokens_per_cta - 1) / tokens_per_cta;
  const int64_t tiles = (p.max_kv_len + 63) / 64;
  const int64_t slots = int64_t(std::max(sm_count, 1)) * 8;
  const int64_t per_cta = (tiles * groups * p.batch + slots - 1) / slots;
  return int(std::min<int64_t>(std::max<int64_t>(per_cta, 4), 64));
}

}  // namespace

Status invokeIndexScores(const IndexScoresParams& p, const IndexCache& cache, Arch arch, cudaStream_t stream) {
  using namespace index_scores_detail;
  if (p.heads != 16 && p.heads != 32 && p.heads != 64) return Status::kInvalidArgument;
  if (p.num_tokens < 0 || p.batch < 0 || p.max_q_len < 1 || p.max_kv_len < 1 || p.logits_stride < p.max_kv_len)
    return Status::kInvalidArgument;
  if (cache.page_size < 1 || cache.num_blocks < 0 ||
      (cache.num_blocks > 1 && cache.block_stride_bytes < int64_t(cache.page_size) * kIndexRowBytes) ||
      arch::widest_access(8, {cache.base}, {cache.block_stride_bytes}) != 16)
    return Status::kInvalidArgument;
  const bool e4m3 = p.q_scale != nullptr;
  if (!e4m3 && p.q_dtype != DType::kFloat16 && p.q_dtype != DType::kBFloat16) return Status::kUnsupportedDType;
  const int64_t q_elem = e4m3 ? 1 : 2;
  if (arch::widest_access(8, {p.q}, {p.q_stride_token * q_elem, p.q_stride_head * q_elem}) != 16)
    return Status::kInvalidArgument;
  const Arch tag = resolve_arch(arch, device_compute_capability());
  if (tag == Arch::kAuto) return Status::kUnsupportedArch;
  if (p.batch == 0 || p.num_tokens == 0) return Status::kOk;

  const int tiles = tiles_per_cta(p, device_sm_count());
  const int kind = e4m3 ? kQE4m3 : p.q_dtype == DType::kBFloat16 ? kQBf16 : kQHalf;
  auto run = [&](auto tag_type) {
    using A = decltype(tag_type);
    switch (kind) {
      case kQE4m3: return launch_index_scores<A, kQE4m3>(p, cache, tiles, stream);
      case kQBf16: return launch_index_scores<A, kQBf16>(p, cache, tiles, stream);
      default: return launch_index_scores<A, kQHalf>(p, cache, tiles, stream);
    }
  };
  switch (tag) {
    case Arch::kSm70: return run(arch::Sm70{});
    case Arch::kSm75: return run(arch::Sm75{});
    default: return run(arch::Sm80{});  // the Sm90 tag too: mma.sync, no wgmma variant
  }
}

}  // namespace mla_kv
