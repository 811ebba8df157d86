// Hopper (sm_90a) warpgroup MMA: shared-memory operand descriptors, the async fences, the pipeline
// barriers and the wgmma shapes the attention kernel uses. Everything here compiles to nothing
// outside an sm_90a device pass (MLA_KV_HAS_WGMMA), where the Sm90 kernels that call it are never
// launched.
//
// Operands live in shared memory in the 128-byte swizzled layout: a matrix of 16-bit elements is
// stored as chunks of 64 columns; a chunk holds its rows at a 128-byte pitch and the 16-byte unit u
// of row r at unit u ^ (r % 8), so that eight consecutive rows of one column unit hit all 32 banks.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLA_KV_HAS_WGMMA 1
#else
#define MLA_KV_HAS_WGMMA 0
#endif

namespace mla_kv {
namespace arch {

constexpr int kSwizzleRowBytes = 128;  // one row of a 64-column chunk
constexpr int kSwizzleAtomBytes = 8 * kSwizzleRowBytes;

// The dynamic shared memory `raw` from its first kSwizzleAtomBytes-aligned byte. An offset into the
// __shared__ array keeps the compiler knowing the address space; a pointer rebuilt from an integer
// is generic, and generic loads go through L1TEX and wait on its scoreboard (ncu: 57% of the narrow
// decode kernel's stalls before this).
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  return raw + ((kSwizzleAtomBytes - addr % kSwizzleAtomBytes) % kSwizzleAtomBytes);
}

// Byte offset of 16-byte unit `unit` (0..7) of row `row` inside a swizzled chunk.
__device__ __forceinline__ int swizzled_offset(int row, int unit) {
  return row * kSwizzleRowBytes + ((unit ^ (row & 7)) << 4);
}

// Descriptor of a swizzled operand starting at `p` (a 1024-byte aligned chunk, plus a k offset of
// a multiple of 32 bytes inside the 128-byte rows). stride_bytes: between groups of 8 rows (8 k
// rows for an MN-major operand); leading_bytes: between 64-column chunks of an MN-major operand
// (unused for K-major ones, whose 16-wide k step stays inside one chunk).
__device__ __forceinline__ uint64_t swizzled_desc(const void* p, uint32_t leading_bytes, uint32_t stride_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t(leading_bytes >> 4) << 16 |
         uint64_t(stride_bytes >> 4) << 32 | uint64_t(1) << 62;  // 1: 128-byte swizzle
}
// The same descriptor moved by `bytes` (a multiple of 16) in shared memory.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() {
#if MLA_KV_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if MLA_KV_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if MLA_KV_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
#endif
}
// Keeps the compiler from moving accesses of accumulator registers across a wgmma wait.
template <int N>
__device__ __forceinline__ void pin_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared-memory writes by ordinary stores (and cp.async) become visible to the tensor cores' async
// proxy only after this fence (then a barrier for other threads' writes).
__device__ __forceinline__ void fence_proxy_async() {
#if MLA_KV_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Hopper's pipeline primitives beyond wgmma: mbarriers that cp.async and TMA copies complete,
// named barriers through which the warpgroups hand each other work (ids 1.., 0 is __syncthreads),
// and the register moves between warpgroups.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
#if MLA_KV_HAS_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))),
               "r"(arrivals) : "memory");
#endif
}
// One arrival on `bar` once every cp.async this thread issued before has landed.
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
#if MLA_KV_HAS_WGMMA
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(bar))) : "memory");
#endif
}
// One arrival on `bar` that also expects `bytes` more of asynchronous (TMA) copies in this phase.
__device__ __forceinline__ void mbarrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
#if MLA_KV_HAS_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(bar))), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
#if MLA_KV_HAS_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
               : "memory");
#endif
}
// A box of a 3-D tensor map (coordinates innermost first) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const void* tensor_map, int c0, int c1, int c2, uint64_t* bar) {
#if MLA_KV_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))), "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2),
      "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
      : "memory");
#endif
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory by the
// bulk-copy engine, completing on `bar` (its phase must expect them: mbarrier_arrive_expect).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if MLA_KV_HAS_WGMMA
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))), "l"(src), "r"(bytes),
               "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
               : "memory");
#endif
}
// Waits for the completion of `bar`'s phase of parity `parity`.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#if MLA_KV_HAS_WGMMA
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  uint32_t done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(addr), "r"(parity) : "memory");
  }
#endif
}
// Whether `bar`'s phase of parity `parity` has completed (does not wait).
__device__ __forceinline__ bool mbarrier_done(uint64_t* bar, uint32_t parity) {
  uint32_t done = 1;
#if MLA_KV_HAS_WGMMA
  asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))), "r"(parity) : "memory");
#endif
  return done != 0;
}
// Moves registers between warpgroups (every thread of a warpgroup executes it with the same count).
template <int kRegisters>
__device__ __forceinline__ void grow_registers() {
#if MLA_KV_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void shrink_registers() {
#if MLA_KV_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
#endif
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
#if MLA_KV_HAS_WGMMA
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
#endif
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
#if MLA_KV_HAS_WGMMA
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
#endif
}

// Thread-block clusters: the CTA's rank; a barrier of every thread of the cluster (every one must take
// it: none may have exited), whose release / acquire makes shared-memory writes before it visible to
// the other CTAs' reads after it; loads from another CTA's shared memory at the address `p` has here.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
#if MLA_KV_HAS_WGMMA
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ void cluster_sync() {
#if MLA_KV_HAS_WGMMA
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
#endif
}
__device__ __forceinline__ uint32_t cluster_address(const void* p, uint32_t rank) {
  uint32_t remote = 0;
#if MLA_KV_HAS_WGMMA
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))), "r"(rank));
#endif
  return remote;
}
__device__ __forceinline__ float4 load_cluster_shared_f4(const void* p, uint32_t rank) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if MLA_KV_HAS_WGMMA
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(cluster_address(p, rank)) : "memory");
#endif
  return v;
}
__device__ __forceinline__ float load_cluster_shared_f32(const void* p, uint32_t rank) {
  float v = 0.f;
#if MLA_KV_HAS_WGMMA
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_address(p, rank)) : "memory");
#endif
  return v;
}

// D[64 x N] (fp32, registers) = A[64 x 16] . B[16 x N] (+ D when `accumulate`). A K-major, from
// shared memory (a descriptor) or from registers (a[4]: the mma.sync m16n8k16 A fragment of the
// warp's 16 rows); B from shared memory, K-major ([n][k] rows) or, kBMnMajor, MN-major ([k][n]).
// Accumulator layout: warp w of the warpgroup holds rows 16 w .. 16 w + 15; lane l holds, for each
// 8-column block j, d[4 j + 2 h + e] = D[16 w + l / 4 + 8 h][8 j + 2 (l % 4) + e].
template <class T, int N, bool kBMnMajor>
struct Wgmma;
// D[64 x N] += A[64 x 16] (registers, as above) . B[16 x N] (shared memory, K-major), N = 16 or 24.
template <class T, int N>
struct WgmmaRegA;

#if MLA_KV_HAS_WGMMA
// Operand lists of the 32 and 128 accumulator registers: operand numbers, and the outputs as blocks
// of 32 registers starting at d[o].
#define MLA_KV_WGMMA_D32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MLA_KV_WGMMA_D128 \
  MLA_KV_WGMMA_D32 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, " \
  "%68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
  "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, " \
  "%104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, " \
  "%119, %120, %121, %122, %123, %124, %125, %126, %127"

#define MLA_KV_WGMMA_OUT32(d, o) \
  "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), \
  "+f"(d[o + 6]), "+f"(d[o + 7]), "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]), "+f"(d[o + 11]), \
  "+f"(d[o + 12]), "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15]), "+f"(d[o + 16]), \
  "+f"(d[o + 17]), "+f"(d[o + 18]), "+f"(d[o + 19]), "+f"(d[o + 20]), "+f"(d[o + 21]), \
  "+f"(d[o + 22]), "+f"(d[o + 23]), "+f"(d[o + 24]), "+f"(d[o + 25]), "+f"(d[o + 26]), \
  "+f"(d[o + 27]), "+f"(d[o + 28]), "+f"(d[o + 29]), "+f"(d[o + 30]), "+f"(d[o + 31])
#define MLA_KV_WGMMA_D32_OUT(d) MLA_KV_WGMMA_OUT32(d, 0)
#define MLA_KV_WGMMA_D128_OUT(d) \
  MLA_KV_WGMMA_OUT32(d, 0), MLA_KV_WGMMA_OUT32(d, 32), MLA_KV_WGMMA_OUT32(d, 64), MLA_KV_WGMMA_OUT32(d, 96)

// The scores' shape (m64n64k16, B K-major) and the output's (m64n256k16, B MN-major, A from shared
// memory or registers), for each 16-bit type.
#define MLA_KV_WGMMA_SHAPES(T, PTX_TYPE)                                                                              \
  template <> struct Wgmma<T, 64, false> {                                                                           \
    static __device__ __forceinline__ void mma(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {             \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                      \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE " {" MLA_KV_WGMMA_D32         \
                   "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                                                \
                   : MLA_KV_WGMMA_D32_OUT(d)                                                                         \
                   : "l"(a), "l"(b), "r"(accumulate));                                                               \
    }                                                                                                                \
  };                                                                                                                 \
  template <> struct Wgmma<T, 256, true> {                                                                           \
    static __device__ __forceinline__ void mma(float (&d)[128], uint64_t a, uint64_t b, int accumulate) {            \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                     \
                   "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX_TYPE "." PTX_TYPE " {" MLA_KV_WGMMA_D128       \
                   "}, %128, %129, p, 1, 1, 0, 1;\n}\n"                                                              \
                   : MLA_KV_WGMMA_D128_OUT(d)                                                                        \
                   : "l"(a), "l"(b), "r"(accumulate));                                                               \
    }                                                                                                                \
    static __device__ __forceinline__ void mma(float (&d)[128], const uint32_t (&a)[4], uint64_t b,                  \
                                               int accumulate) {                                                     \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                                     \
                   "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX_TYPE "." PTX_TYPE " {" MLA_KV_WGMMA_D128       \
                   "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                                             \
                   : MLA_KV_WGMMA_D128_OUT(d)                                                                        \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));                           \
    }                                                                                                                \
  };

// The narrow kernel's shapes (attention_sm90_narrow.cuh): m64nNk16, A from registers, B K-major,
// N = 16 or 24 (8 or 12 accumulator registers).
#define MLA_KV_WGMMA_NARROW(T, PTX_TYPE)                                                                          \
  template <> struct WgmmaRegA<T, 16> {                                                                          \
    static __device__ __forceinline__ void mma(float (&d)[8], const uint32_t (&a)[4], uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"                                                  \
                   "wgmma.mma_async.sync.aligned.m64n16k16.f32." PTX_TYPE "." PTX_TYPE                          \
                   " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"                \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
                     "+f"(d[7])                                                                                  \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));                       \
    }                                                                                                            \
  };                                                                                                             \
  template <> struct WgmmaRegA<T, 24> {                                                                          \
    static __device__ __forceinline__ void mma(float (&d)[12], const uint32_t (&a)[4], uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"                                                  \
                   "wgmma.mma_async.sync.aligned.m64n24k16.f32." PTX_TYPE "." PTX_TYPE                          \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
                     "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])                                \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));                       \
    }                                                                                                            \
  };
MLA_KV_WGMMA_NARROW(__nv_bfloat16, "bf16")
MLA_KV_WGMMA_NARROW(__half, "f16")
#undef MLA_KV_WGMMA_NARROW
MLA_KV_WGMMA_SHAPES(__nv_bfloat16, "bf16")
MLA_KV_WGMMA_SHAPES(__half, "f16")
#undef MLA_KV_WGMMA_SHAPES
#undef MLA_KV_WGMMA_D32
#undef MLA_KV_WGMMA_D32_OUT
#undef MLA_KV_WGMMA_D128
#undef MLA_KV_WGMMA_D128_OUT
#undef MLA_KV_WGMMA_OUT32
#else
template <class T, int N, bool kBMnMajor>
struct Wgmma {
  static __device__ __forceinline__ void mma(float (&)[N / 2], uint64_t, uint64_t, int) {}
  static __device__ __forceinline__ void mma(float (&)[N / 2], const uint32_t (&)[4], uint64_t, int) {}
};
template <class T, int N>
struct WgmmaRegA {
  static __device__ __forceinline__ void mma(float (&)[N / 2], const uint32_t (&)[4], uint64_t, int) {}
};
#endif

}  // namespace arch
}  // namespace mla_kv
