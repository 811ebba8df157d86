// Host side of the arch layer: which tag a device runs, and status strings.
#include <cuda_runtime.h>

#include "arch.cuh"
#include "mla_kv/arch.h"
#include "mla_kv/layout.h"

#ifndef MLA_KV_CUDA_ARCHS
#error "MLA_KV_CUDA_ARCHS (e.g. \"75,80,90\") is set by the build"
#endif

namespace mla_kv {
namespace {

constexpr int kMaxDevices = 64;

// Highest compiled target the device can run natively (0 if none): a tag's kernels exist only for
// targets at or above the tag, so this bounds the tags that have real code on the device.
int best_compiled_target(int cc) {
  int best = 0, value = 0;
  for (const char* c = MLA_KV_CUDA_ARCHS;; ++c) {
    if (*c >= '0' && *c <= '9') {
      value = value * 10 + (*c - '0');
    } else {
      if (value <= cc && value > best) best = value;
      value = 0;
      if (*c == '\0') break;
    }
  }
  return best;
}

}  // namespace

int device_compute_capability() {
  static int cached[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev < kMaxDevices && cached[dev]) return cached[dev];
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  const int cc = major * 10 + minor;
  if (dev < kMaxDevices) cached[dev] = cc;
  return cc;
}

int device_sm_count() {
  static int cached[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev < kMaxDevices && cached[dev]) return cached[dev];
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
  if (dev < kMaxDevices) cached[dev] = count;
  return count;
}

bool tag_has_bf16(Arch tag) {
  switch (tag) {
    case Arch::kSm70: return arch::Sm70::kHasBf16;
    case Arch::kSm75: return arch::Sm75::kHasBf16;
    case Arch::kSm80: return arch::Sm80::kHasBf16;
    case Arch::kSm90: return arch::Sm90::kHasBf16;
    default: return false;
  }
}

SmemLimits device_smem_limits() {
  static SmemLimits cached[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return {};
  if (dev < kMaxDevices && cached[dev].per_block) return cached[dev];
  SmemLimits l;
  cudaDeviceGetAttribute(&l.per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  cudaDeviceGetAttribute(&l.per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
  cudaDeviceGetAttribute(&l.reserved_per_block, cudaDevAttrReservedSharedMemoryPerBlock, dev);
  if (dev < kMaxDevices) cached[dev] = l;
  return l;
}

SmemLimits effective_smem_limits(SmemLimits requested) {
  const SmemLimits d = device_smem_limits();
  // (no device: the requested values as they are, so plans can be made on a machine without a GPU)
  auto held = [](int want, int have) { return have == 0 || (want > 0 && want < have) ? want : have; };
  // The reserve is the emulated GPU's when limits are given (a T4 reserves none; the H200 that
  // emulates it 1 KB, which its far larger SM holds anyway).
  return {held(requested.per_block, d.per_block), held(requested.per_sm, d.per_sm),
          requested.per_block > 0 ? requested.reserved_per_block : d.reserved_per_block};
}

Arch resolve_arch(Arch requested, int compute_capability) {
  const int target = best_compiled_target(compute_capability);
  if (target == 0) return Arch::kAuto;
  if (requested == Arch::kAuto) {
    if (target >= 90) return Arch::kSm90;
    if (target >= 80) return Arch::kSm80;
    return target >= 75 ? Arch::kSm75 : Arch::kSm70;
  }
  return static_cast<int>(requested) <= target ? requested : Arch::kAuto;
}

const char* compiled_cuda_archs() { return MLA_KV_CUDA_ARCHS; }

const char* status_string(Status s) {
  switch (s) {
    case Status::kOk: return "ok";
    case Status::kUnsupportedDType: return "dtype not supported by this arch variant";
    case Status::kUnsupportedArch: return "no kernel variant for this GPU / arch tag in this build";
    case Status::kInvalidArgument: return "invalid argument (alignment or size)";
    case Status::kCudaError: return "CUDA error";
    case Status::kSharedMemoryExceeded:
      return "no tile configuration of this arch variant fits the shared memory per block (see attention_tiles)";
    case Status::kUnsupportedFormat: return "this op does not support the cache's kv_format";
  }
  return "unknown status";
}

}  // namespace mla_kv
