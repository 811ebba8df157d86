// The one small layer that knows about architectures: arch tags, element conversions and 16-byte
// vector memory access. Kernels are templates on a tag; a tag's body is compiled only for targets
// that can run it (MLA_KV_ARCH_GUARD), so the Sm70 variant exists in an sm_90 build and runs there.
#pragma once

#include <cstdint>
#include <initializer_list>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "mla_kv/arch.h"

// For the lambdas of the kernels' main loops: clang may leave a large one outlined, and every value
// it captures by reference then lives in local memory (208-384 bytes per thread in the Sm70 / Sm75
// quantized attention kernels); nvcc inlines them.
#if defined(__clang__)
#define MLA_KV_INLINE_LAMBDA __attribute__((always_inline))
#else
#define MLA_KV_INLINE_LAMBDA
#endif

namespace mla_kv {
namespace arch {

struct Sm70 {
  static constexpr Arch kArch = Arch::kSm70;
  static constexpr int kMinCudaArch = 700;
  static constexpr bool kHasBf16 = false;
};
struct Sm75 {
  static constexpr Arch kArch = Arch::kSm75;
  static constexpr int kMinCudaArch = 750;
  static constexpr bool kHasBf16 = false;
};
struct Sm80 {
  static constexpr Arch kArch = Arch::kSm80;
  static constexpr int kMinCudaArch = 800;
  static constexpr bool kHasBf16 = true;
};
// Hopper: wgmma, which exists only in sm_90a code (the build compiles its sm_90 target as sm_90a).
struct Sm90 {
  static constexpr Arch kArch = Arch::kSm90;
  static constexpr int kMinCudaArch = 900;
  static constexpr bool kHasBf16 = true;
};

// True in the device pass for a target that can run tag A's instructions (and on the host).
template <class A>
__host__ __device__ constexpr bool target_supports() {
#if defined(__CUDA_ARCH__)
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if (A::kMinCudaArch >= 900) return false;
#endif
  return __CUDA_ARCH__ >= A::kMinCudaArch;
#else
  return true;
#endif
}

// The threads one SM of the compile target holds (sm_75: 1,024; sm_86 / sm_87 / sm_89: 1,536; the others
// 2,048); on the host, where launch bounds mean nothing, 2,048.
__host__ __device__ constexpr int target_threads_per_sm() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
  return 1024;
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890)
  return 1536;
#else
  return 2048;
#endif
}

// A __launch_bounds__ min-blocks value for blocks of `threads`: `blocks`, or as many as one SM of the compile
// target holds where fewer. Given more, ptxas warns (".minnctapersm will be ignored", once per kernel) and
// compiles as with that many: the sm_75 code of the write kernels (10 blocks of 128 threads asked, 8 fit)
// is the same either way (checked section by section on the cubin), without the warning.
__host__ __device__ constexpr int target_min_blocks(int threads, int blocks) {
  return threads * blocks <= target_threads_per_sm() ? blocks : target_threads_per_sm() / threads;
}

// --- element conversions (fp32 math everywhere) ---
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// 2^x on the special-function unit, results below 2^-126 flushed to zero (softmax weights that
// small change no sum), without exp2f's denormal handling (predicates and registers).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x on the special-function unit: at most 2^-22 from the quotient (PTX: 2^-23 absolute on [1, 2)),
// one instruction where 1.f / x takes a refinement and a branch to the slow path.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// N elements of T moved as one access (16 bytes when N * sizeof(T) == 16).
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Streaming read of data used once (inputs): read-only path, no L1 allocation on Sm80+.
template <class A, class T, int N>
__device__ __forceinline__ Vec<T, N> load_stream(const T* p) {
  const auto* vp = reinterpret_cast<const Vec<T, N>*>(p);
  if constexpr (sizeof(Vec<T, N>) == 16) {
    int4 r;
    if constexpr (A::kMinCudaArch >= 800) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(vp));
    } else {
      r = __ldg(reinterpret_cast<const int4*>(vp));
    }
    Vec<T, N> out;
    *reinterpret_cast<int4*>(&out) = r;
    return out;
  } else {
    return *vp;
  }
}

// Read of small data reused by many threads (weights, cos/sin rows): read-only cached path.
template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_cached(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <class T, int N>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// One 16- / 8-byte shared-memory load that stays one instruction: from a plain vector load whose
// words are used apart, nvcc may make four (two) 4-byte ones (the narrow kernel's int K pass did:
// four times the MIO issues). volatile keeps it after the mbarrier wait that made the bytes land.
__device__ __forceinline__ uint4 load_shared_16(const void* p) {  // sanitize-allow: merge-reads {
  uint4 r;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
  return r;
}
__device__ __forceinline__ uint2 load_shared_8(const void* p) {
  uint2 r;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
  return r;
}  // sanitize-allow: merge-reads }

// Programmatic dependent launch (sm90): a grid that runs launch_dependents lets the next kernel of
// its stream, when launched with programmatic stream serialization, start before it ends; that
// kernel runs wait_for_prior_grid before it reads anything the grid wrote (the wait returns once
// the grid has completed and its writes are visible). Both do nothing on older targets, and the
// wait returns at once in a kernel launched in plain stream order.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Host side: the widest access (16 bytes, else two elements, else 0 = unsupported) that every
// given address and byte stride/offset of an op allows.
inline int64_t widest_access(int64_t elem_bytes, std::initializer_list<const void*> ptrs,
                             std::initializer_list<int64_t> byte_strides) {
  for (int64_t bytes : {int64_t(16), 2 * elem_bytes}) {
    bool ok = true;
    for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % bytes == 0;
    for (int64_t s : byte_strides) ok = ok && s % bytes == 0;
    if (ok) return bytes;
  }
  return 0;
}

// Sm80+ asynchronous global -> shared copies (Volta and Turing stage through registers instead).
// A false `valid` writes 16 zero bytes without reading `src`.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {  // sanitize-allow: probs {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(valid ? 16 : 0));
#endif  // sanitize-allow: probs }
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;");
#endif
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

}  // namespace arch
}  // namespace mla_kv
