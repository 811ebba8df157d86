// The length-aware work plan's buffer, as the plan kernel (plan.cu) writes it and the attention
// kernels and the combine read it: a header, the work items (one per CTA), the split units and the
// combine's two row lists. Host and device code share it.
#pragma once

#include <cstddef>

#include "mla_kv/attention.h"

namespace mla_kv {
namespace attention_detail {

// Header words.
constexpr int kPlanItems = 0;     // work items of this step (CTAs past it exit at once)
constexpr int kPlanFewRows = 1;   // rows of units split 2..kFewSplits ways
constexpr int kPlanManyRows = 2;  // rows of units split more ways
constexpr int kPlanChunk = 3;     // the chunk, in 64-token tiles
constexpr int kPlanUnits = 4;     // split units
constexpr int kPlanHeaderWords = 8;

// A CTA's work: query rows [row0, row0 + block_m) of sequence b over kv positions [kv_lo, kv_hi).
// slot >= 0: the unit is split, and the CTA leaves its partial state in workspace rows
// slot * block_m .. ; -1: the CTA writes out / lse itself.
struct PlanItem {
  int b, row0, kv_lo, kv_hi;
  int kv_len, slot, unit, unused;
};
// A split unit: its partial states are in slots slot0 .. slot0 + splits - 1.
struct PlanUnit {
  int b, row0, slot0, splits;
};

struct PlanView {
  const int* header;
  const PlanItem* items;
  const PlanUnit* units;
  const int* few_rows;   // unit * 64 + row within the unit
  const int* many_rows;
};

__host__ __device__ inline size_t plan_items_offset() { return kPlanHeaderWords * sizeof(int); }
__host__ __device__ inline size_t plan_units_offset(const AttentionPlanSizes& s) {
  return plan_items_offset() + size_t(s.max_items) * sizeof(PlanItem);
}
__host__ __device__ inline size_t plan_rows_offset(const AttentionPlanSizes& s) {
  return plan_units_offset(s) + size_t(s.max_units) * sizeof(PlanUnit);
}
__host__ __device__ inline size_t plan_bytes_of(const AttentionPlanSizes& s) {
  return plan_rows_offset(s) + 2 * size_t(s.max_rows) * sizeof(int);
}

template <class Int>
__host__ __device__ inline PlanView plan_view(Int* plan, const AttentionPlanSizes& s) {
  const char* base = reinterpret_cast<const char*>(plan);
  const int* rows = reinterpret_cast<const int*>(base + plan_rows_offset(s));
  return {reinterpret_cast<const int*>(base), reinterpret_cast<const PlanItem*>(base + plan_items_offset()),
          reinterpret_cast<const PlanUnit*>(base + plan_units_offset(s)), rows, rows + s.max_rows};
}

}  // namespace attention_detail
}  // namespace mla_kv
