// Warp-level tensor-core tile per arch tag: C[16x16] (fp32) += A[16x16] * B[16x16] from shared memory.
//
// One shape for every arch keeps the attention kernels arch-free; each tag maps it onto its own
// instruction: Sm80 two mma.m16n8k16 (fp16/bf16), Sm75 four mma.m16n8k8 (fp16), Sm70 four
// mma.m8n8k4 (fp16; each of the warp's four quad-pairs computes one 8x8 quarter of the tile).
// Sm75/Sm80 load fragments with ldmatrix; Sm70 with plain shared-memory loads (Volta has no
// ldmatrix). Operand fragments (FragA, FragB) are separate objects so that a kernel loads an
// operand once and reuses it against several tiles of the other. acc_row/acc_col say where
// accumulator element i of a lane sits in the tile, so softmax and epilogues are written once for
// all tags (kAccRowLanes: which lanes share a column). An A operand (load_a) keeps its row r at
// shared-memory row a_row(r), which writers of A tiles (Q, P) use too: the identity on Sm75 / Sm80,
// whose ldmatrix reads are conflict-free; on Sm70 rows 4-7 and 8-11 of every 16 trade places (see
// there).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "arch.cuh"

namespace mla_kv {
namespace arch {

__device__ __forceinline__ uint32_t pack2(const void* lo, const void* hi) {
  return uint32_t(*static_cast<const uint16_t*>(lo)) | (uint32_t(*static_cast<const uint16_t*>(hi)) << 16);
}

template <class A, class T>
struct WarpMma16;

// ---------------------------------------------------------------- Sm80 / Sm75 (same fragments)
// Fragments of thread (g = lane / 4, t = lane % 4). A regs: (g, 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..).
// B regs per 8-column half: (k 2t..2t+1, n g), (k 2t+8.., n g). C: (g, 2t..2t+1), (g+8, 2t..).
template <class T>
struct Sm8xFragments {
  struct FragA {
    uint32_t r[4];
  };
  struct FragB {
    uint32_t r[2][2];  // [n half][k half]
  };

  // ldmatrix: each lane names one 16-byte row of one of the four 8x8 matrices (lanes 8i..8i+7 ->
  // matrix i), and receives its fragment of each. Rows must be 16-byte aligned.
  __device__ __forceinline__ static void ldmatrix_x4(uint32_t (&r)[4], const T* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(static_cast<unsigned>(__cvta_generic_to_shared(row))));
  }
  __device__ __forceinline__ static void ldmatrix_x4_trans(uint32_t (&r)[4], const T* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(static_cast<unsigned>(__cvta_generic_to_shared(row))));
  }

  // A stored [m][k] (k contiguous), leading dim ld elements: matrices (m 0-7 | 8-15) x (k 0-7 | 8-15).
  __device__ __forceinline__ static void load_a(FragA& f, const T* s, int ld, int lane) {
    const int mat = lane >> 3;
    ldmatrix_x4(f.r, s + ((mat & 1) * 8 + (lane & 7)) * ld + (mat >> 1) * 8);
  }
  // B stored [n][k] (k contiguous): the K^T operand of Q.K^T.
  __device__ __forceinline__ static void load_b_nk(FragB& f, const T* s, int ld, int lane) {
    const int mat = lane >> 3;
    uint32_t r[4];
    ldmatrix_x4(r, s + ((mat >> 1) * 8 + (lane & 7)) * ld + (mat & 1) * 8);
    f.r[0][0] = r[0]; f.r[0][1] = r[1]; f.r[1][0] = r[2]; f.r[1][1] = r[3];
  }
  // B stored [k][n] (n contiguous): the V operand of P.V, transposed on the way in.
  __device__ __forceinline__ static void load_b_kn(FragB& f, const T* s, int ld, int lane) {
    const int mat = lane >> 3;
    uint32_t r[4];
    ldmatrix_x4_trans(r, s + ((mat & 1) * 8 + (lane & 7)) * ld + (mat >> 1) * 8);
    f.r[0][0] = r[0]; f.r[0][1] = r[1]; f.r[1][0] = r[2]; f.r[1][1] = r[3];
  }
  // Lane bits that change only an accumulator's row (with bit 1 of i in every tag): xor-shuffles over
  // them, after adding elements i and i | 2, sum a tile's 16 rows per column.
  static constexpr int kAccRowLanes = 0b11100;
  __device__ __forceinline__ static int acc_row(int lane, int i) { return (lane >> 2) + ((i >> 1) & 1) * 8; }
  __device__ __forceinline__ static int acc_col(int lane, int i) { return (i >> 2) * 8 + 2 * (lane & 3) + (i & 1); }
  __device__ __forceinline__ static int a_row(int r) { return r; }
};

template <class T>
struct WarpMma16<Sm80, T> : Sm8xFragments<T> {
  using typename Sm8xFragments<T>::FragA;
  using typename Sm8xFragments<T>::FragB;
  __device__ __forceinline__ static void mma(float (&c)[8], const FragA& a, const FragB& b) {
    constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* d = c + 4 * h;
      if constexpr (kBf16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[h][0]), "r"(b.r[h][1]));
      } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[h][0]), "r"(b.r[h][1]));
      }
    }
  }
};

template <>
struct WarpMma16<Sm75, __half> : Sm8xFragments<__half> {
  __device__ __forceinline__ static void mma(float (&c)[8], const FragA& a, const FragB& b) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* d = c + 4 * h;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a.r[2 * k]), "r"(a.r[2 * k + 1]), "r"(b.r[h][k]));
      }
    }
  }
};

// ---------------------------------------------------------------- Sm70
// Quad-pair q = (lane / 4) % 4 computes the 8x8 quarter (rows (q & 1) * 8.., cols (q >> 1) * 8..).
// Within it, lane's A row and B column are r = lane % 4 + 4 * (lane >= 16), each holding 4 k values
// per m8n8k4; accumulator i sits at row (lane & 1) + (i & 2) + 4 * (lane >= 16), col (i & 4) +
// (lane & 2) + (i & 1).
template <>
struct WarpMma16<Sm70, __half> {
  struct FragA {
    uint32_t r[4][2];  // [k step of 4][2 x f16x2]
  };
  struct FragB {
    uint32_t r[4][2];
  };

  __device__ __forceinline__ static int quad_pair(int lane) { return (lane >> 2) & 3; }
  __device__ __forceinline__ static int own_index(int lane) { return (lane & 3) + ((lane >> 4) << 2); }

  // A lane's 16 k values of one row (A [m][k]) or column (B stored [n][k]): four k steps of 4.
  __device__ __forceinline__ static void load_k_run(uint32_t (&r)[4][2], const __half* run) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint2 v = *reinterpret_cast<const uint2*>(run + 4 * k);
      r[k][0] = v.x;
      r[k][1] = v.y;
    }
  }
  // The 8 lanes of one shared-memory phase read A rows 0-3 and 8-11 of a 16-row block (quad-pairs 0
  // and 1); rows r and r + 8 of a pitch that is an odd multiple of 16 bytes share banks, rows 0-7 do
  // not. Storing rows 8-11 where rows 4-7 would be (bits 2 and 3 of the row swapped) makes those
  // 8 reads conflict-free.
  __device__ __forceinline__ static int a_row(int r) { return r ^ ((((r >> 2) ^ (r >> 3)) & 1) * 12); }
  __device__ __forceinline__ static void load_a(FragA& f, const __half* s, int ld, int lane) {
    load_k_run(f.r, s + a_row((quad_pair(lane) & 1) * 8 + own_index(lane)) * ld);
  }
  __device__ __forceinline__ static void load_b_nk(FragB& f, const __half* s, int ld, int lane) {
    load_k_run(f.r, s + ((quad_pair(lane) >> 1) * 8 + own_index(lane)) * ld);
  }
  __device__ __forceinline__ static void load_b_kn(FragB& f, const __half* s, int ld, int lane) {
    const int q = quad_pair(lane);
    const __half* col = s + (q >> 1) * 8 + own_index(lane);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f.r[k][0] = pack2(col + (4 * k) * ld, col + (4 * k + 1) * ld);
      f.r[k][1] = pack2(col + (4 * k + 2) * ld, col + (4 * k + 3) * ld);
    }
  }
  __device__ __forceinline__ static void mma(float (&c)[8], const FragA& a, const FragB& b) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      asm volatile(
          "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, "
          "{%0,%1,%2,%3,%4,%5,%6,%7};"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7])
          : "r"(a.r[k][0]), "r"(a.r[k][1]), "r"(b.r[k][0]), "r"(b.r[k][1]));
    }
  }
  static constexpr int kAccRowLanes = 0b10101;
  __device__ __forceinline__ static int acc_row(int lane, int i) {
    return (quad_pair(lane) & 1) * 8 + (lane & 1) + (i & 2) + ((lane >> 4) << 2);
  }
  __device__ __forceinline__ static int acc_col(int lane, int i) {
    return (quad_pair(lane) >> 1) * 8 + (i & 4) + (lane & 2) + (i & 1);
  }
};

}  // namespace arch
}  // namespace mla_kv
