"""The one-line kernel mutations that scripts/mutate applies, each to its own copy of csrc/.

A mutation names the exact text it replaces (unique in its file, or the `occurrence`-th of several),
the test files that must kill it (run in that order, stopping at the first failure) and why a correct
test suite catches it. `focus` is a pytest -k expression run first as a fast kill; the files' other
tests run after it when it passes (or selects nothing), so a stale focus costs time, never a verdict.

Fields that say what a mutation covers (tests/test_mutate.py checks that the list covers them all):
  family  the kernel family changed: write, gather, attention, combine, merge, schedule
  archs   the arch tags whose kernels run the changed code (the write and gather kernels have Sm70
          and Sm80 variants only: Sm75 devices run the first, Sm90 devices the second)
  topics  what the changed line does (see TOPICS)

Mutants that cannot change a result are left out; examples of what was rejected and why:
  - merge_states' both-empty guard (`m == -INFINITY ? 0.f :`) on wa alone: NaN weights then fail
    `wa > 0.f` and `denom > 0.f`, so the row is still 0 and its lse -inf;
  - raised_max's threshold 8 -> 0 (same result, more rescaling) or -> 16 (P stays below fp16's max
    except for jumps within 2^-14 of 16);
  - one more split per wave in the schedule (stays within the two-CTAs-per-SM bound the test checks
    and changes no result);
  - the TMA copy's past-the-end block for boxes beyond kv_hi (their scores are masked and their V
    rows zeroed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

ARCHS = ("Sm70", "Sm75", "Sm80", "Sm90")
ALL = ARCHS
WRITE_ARCHS = ("Sm70", "Sm80")   # write/gather variants (Sm75 runs Sm70's, Sm90 runs Sm80's)
MMA_SYNC = ("Sm70", "Sm75", "Sm80")  # attention_kernel (attention_mma_sync.cuh)
FAMILIES = ("write", "gather", "attention", "expanded", "combine", "merge", "schedule", "indexer")
INDEX_SCORES_ARCHS = ("Sm70", "Sm75", "Sm80")  # index_scores_kernel (the Sm90 tag runs the Sm80 one)
TOPICS = ("plain write", "fused write", "paged slots", "block pointers", "paged table", "decode",
          "prefill", "mask", "guard", "rescale", "lse", "split", "rope", "rmsnorm", "softmax", "mma",
          "pipeline", "TMA", "cp.async", "addressing", "dispatch", "context parallel", "quantized", "sparse",
          "index scores", "index topk", "index keys")

WRITE_CUH = "csrc/kernels/write/write_kv.cuh"
ADDRESS_CUH = "csrc/kernels/address.cuh"
ARCH_CUH = "csrc/kernels/arch/arch.cuh"
MMA_CUH = "csrc/kernels/arch/mma.cuh"
WGMMA_CUH = "csrc/kernels/arch/wgmma.cuh"
FP8_CUH = "csrc/kernels/arch/fp8.cuh"
DEQUANT_CUH = "csrc/kernels/dequant.cuh"
GATHER_CUH = "csrc/kernels/gather/gather_kv.cuh"
COMMON_CUH = "csrc/kernels/attention/common.cuh"
MMA_SYNC_CUH = "csrc/kernels/attention/attention_mma_sync.cuh"
COMBINE_CU = "csrc/kernels/attention/combine.cu"
PLAN_CU = "csrc/kernels/attention/plan.cu"
ATTENTION_CU = "csrc/kernels/attention/attention.cu"
SM90_CUH = "csrc/kernels/attention/attention_sm90.cuh"
NARROW_CUH = "csrc/kernels/attention/attention_sm90_narrow.cuh"
EXPANDED_CUH = "csrc/kernels/expanded/expanded_attention.cuh"
MERGE_CU = "csrc/kernels/attention/merge.cu"
INDEX_SCORES_CUH = "csrc/kernels/indexer/index_scores.cuh"
INDEX_TOPK_CUH = "csrc/kernels/indexer/index_topk.cuh"  # one kernel for every tag
INDEX_KEYS_CUH = "csrc/kernels/indexer/index_keys.cuh"

T_WRITE = ("tests/test_write.py",)
T_GATHER = ("tests/test_gather.py",)
T_ATTENTION = ("tests/test_attention.py",)
T_SCORES = ("tests/test_attention_scores.py",)  # built score patterns: jumps, growing logits, sinks
T_GUARDS = ("tests/test_attention_guards.py",)  # reads past the table, NaN canaries around targets
T_QUANT_WRITE = ("tests/test_write_quant.py",)
T_QUANT_GATHER = ("tests/test_gather_quant.py",)
T_QUANT_ATTENTION = ("tests/test_attention_quant.py",)
T_PLAN = ("tests/test_attention_plan.py",)
T_EXPANDED = ("tests/test_expanded_attention.py",)
T_SWEEP = ("tests/test_sweep.py",)
T_SPARSE = ("tests/test_sparse_attention.py",)
T_INDEX_TOPK = ("tests/test_index_topk.py",)
T_INDEX_KEYS = ("tests/test_index_keys.py",)
T_INDEX_SCORES = ("tests/test_index_scores.py",)  # seeded random configurations of every op, canaries around every tensor
# Rescaling only matters when a later tile's max beats the running one by 2^8: random data never
# does, only tests that plant such scores (named after score jumps / patterns in the suite).
RESCALE_FOCUS = "jump or pattern or rescale"


@dataclass(frozen=True)
class Mutation:
    id: str
    family: str
    archs: Tuple[str, ...]
    topics: Tuple[str, ...]
    file: str
    original: str
    replacement: str
    tests: Tuple[str, ...]
    description: str
    occurrence: int = 0  # 0: `original` occurs exactly once in `file`; n >= 1: the n-th occurrence
    focus: Optional[str] = None


MUTATIONS = (
    # ------------------------------------------------------------------ write / fused write
    Mutation("write-rms-mean-over-row", "write", WRITE_ARCHS, ("fused write", "rmsnorm"), WRITE_CUH,
             "warp_sum(sumsq) / kLatentDim + p.rms_eps", "warp_sum(sumsq) / kRowDim + p.rms_eps", T_WRITE,
             "RMSNorm mean over the 576-value row instead of the 512 latent values (inv_rms 6% high)",
             focus="fused"),
    Mutation("write-rms-eps-dropped", "write", WRITE_ARCHS, ("fused write", "rmsnorm"), WRITE_CUH,
             "warp_sum(sumsq) / kLatentDim + p.rms_eps", "warp_sum(sumsq) / kLatentDim", T_WRITE,
             "RMSNorm without eps: a zero row becomes 0 x inf = NaN, subnormal rows blow up",
             focus="zero or fused"),
    Mutation("write-rope-neox-sin-sign", "write", WRITE_ARCHS, ("fused write", "rope"), WRITE_CUH,
             "a.v[k] = arch::from_float<T>(x * c - y * s);", "a.v[k] = arch::from_float<T>(x * c + y * s);",
             T_WRITE, "neox RoPE: first half rotated by -theta", focus="fused"),
    Mutation("write-rope-interleaved-sin-sign", "write", WRITE_ARCHS, ("fused write", "rope"), WRITE_CUH,
             "v.v[k + 1] = arch::from_float<T>(y * c + x * s);", "v.v[k + 1] = arch::from_float<T>(y * c - x * s);",
             T_WRITE, "interleaved RoPE: odd elements rotated by -theta", focus="fused"),
    Mutation("write-rope-style-swapped", "write", WRITE_ARCHS, ("fused write", "rope"), WRITE_CUH,
             "if (style == RopeStyle::kNeox) {", "if (style != RopeStyle::kNeox) {", T_WRITE,
             "neox and interleaved pairings swapped", focus="fused"),
    Mutation("write-q-last-head-unrotated", "write", WRITE_ARCHS, ("fused write", "rope"), WRITE_CUH,
             "h < p.q_heads; h += kHeadsPerStep", "h < p.q_heads - 1; h += kHeadsPerStep", T_WRITE,
             "fused write leaves q's last head unrotated", focus="fused"),
    Mutation("write-position-bound", "write", WRITE_ARCHS, ("fused write", "guard"), WRITE_CUH,
             "if (pos < 0 || pos >= p.max_position) return;", "if (pos < 0 || pos > p.max_position) return;",
             T_WRITE + T_SWEEP, "position == max_position reads the cos/sin row past the table and writes the row",
             focus="range or skip"),
    Mutation("write-rope-second-half", "write", WRITE_ARCHS, ("plain write", "paged slots"), WRITE_CUH,
             "arch::store<T, N>(dst_pe + (lane + kPairVecs) * N, pe_b);",
             "arch::store<T, N>(dst_pe + (lane + kPairVecs) * N, pe_a);", T_WRITE,
             "k_pe's second 32 values get a copy of its first 32 (plain and fused writes)"),
    Mutation("write-negative-slot", "write", WRITE_ARCHS, ("paged slots", "guard"), ADDRESS_CUH,
             "if (slot < 0 || block >= cache.num_blocks) return {nullptr, 0};",
             "if (block >= cache.num_blocks) return {nullptr, 0};", T_WRITE + T_SWEEP,
             "padded tokens (slot -1) write the row just before the cache (caught by a canary there)",
             focus="range or skip"),
    Mutation("write-slot-past-cache", "write", WRITE_ARCHS, ("paged slots", "guard"), ADDRESS_CUH,
             "if (slot < 0 || block >= cache.num_blocks) return {nullptr, 0};",
             "if (slot < 0 || block > cache.num_blocks) return {nullptr, 0};", T_WRITE + T_SWEEP,
             "slots of block num_blocks write past the cache's end (caught by a canary there)",
             focus="range or skip"),
    Mutation("write-token-past-batch", "write", WRITE_ARCHS, ("block pointers", "guard"), ADDRESS_CUH,
             "if (t >= to.cu_q_lens[cache.batch]) return {nullptr, 0};", "if (t > to.cu_q_lens[cache.batch]) return {nullptr, 0};",
             T_WRITE + T_SWEEP, "block pointers: the first token past cu_q_lens[B] is written into the last sequence",
             focus="blocks or block_pointer"),
    Mutation("write-block-list-bound", "write", WRITE_ARCHS, ("block pointers", "guard"), ADDRESS_CUH,
             "if (block >= cache.cu_block_nums[b + 1] - first) return {nullptr, 0};",
             "if (block > cache.cu_block_nums[b + 1] - first) return {nullptr, 0};", T_WRITE + T_SWEEP,
             "block pointers: a position one block past a sequence's list writes through the next "
             "sequence's first block", focus="blocks or block_pointer"),
    Mutation("write-readonly-last-row", "write", WRITE_ARCHS, ("block pointers", "guard"), ADDRESS_CUH,
             "if (to.readonly_lens != nullptr && local < to.readonly_lens[b]) return {nullptr, 0};",
             "if (to.readonly_lens != nullptr && local < to.readonly_lens[b] - 1) return {nullptr, 0};", T_WRITE,
             "block pointers: the last read-only row (a shared prefix block) is overwritten", focus="readonly"),
    Mutation("write-other-cp-rank", "write", WRITE_ARCHS, ("block pointers", "context parallel"), ADDRESS_CUH,
             "if (pos < 0 || pos % to.cp_size != to.cp_rank) return {nullptr, 0};",
             "if (pos < 0) return {nullptr, 0};", T_WRITE,
             "block pointers under context parallelism: every rank writes every token", focus="cp"),
    Mutation("quant-int4-nibble-order", "write", WRITE_ARCHS, ("quantized", "plain write"), WRITE_CUH,
             "low_bytes(m[0], m[4], m[1], m[5]) | low_bytes(m[2], m[6], m[3], m[7]) << 4",
             "low_bytes(m[0], m[2], m[4], m[6]) | low_bytes(m[1], m[3], m[5], m[7]) << 4",
             T_QUANT_WRITE, "int4 codes packed in the natural nibble order, not TurboMind's 0,2,4,6,1,3,5,7",
             focus="int4"),
    Mutation("quant-ds-mla-tile-scale", "write", WRITE_ARCHS, ("quantized", "plain write"), WRITE_CUH,
             "const uint32_t other = __shfl_xor_sync(0xffffffffu, both, o);",
             "const uint32_t other = __shfl_xor_sync(0xffffffffu, both, o / 2);", T_QUANT_WRITE,
             "fp8_ds_mla: each tile's scale from the amax of 64 of its 128 values (sm80+'s packed pairs)",
             focus="ds_mla"),
    Mutation("quant-ds-mla-scale-by-product", "write", WRITE_ARCHS, ("quantized", "plain write"), WRITE_CUH,
             "const float exact = fmaf(fmaf(-q, 448.f, amax), kInv448, q);", "const float exact = q;",
             T_QUANT_WRITE, "fp8_ds_mla: the tile scale amax x fl(1 / 448), not the quotient (an ulp off for "
             "about half of the 16-bit amaxes)", focus="ds_mla"),
    Mutation("quant-fp8-product-trusted", "write", WRITE_ARCHS, ("quantized", "plain write"), WRITE_CUH,
             "if (near) for_vectors(", "if (false) for_vectors(", T_QUANT_WRITE,
             "fp8: the lower bracketing product's bytes kept where the bracket straddles a rounding boundary "
             "(ties round toward zero, not to even)", focus="boundaries and fp8"),
    Mutation("quant-ds-mla-product-trusted", "write", WRITE_ARCHS, ("quantized", "plain write"), WRITE_CUH,
             "if (near) {", "if (false) {", T_QUANT_WRITE,
             "fp8_ds_mla: the lower bracketing product's bytes kept where the bracket straddles a rounding "
             "boundary", focus="boundaries and ds_mla"),
    Mutation("quant-int-divides", "write", WRITE_ARCHS, ("quantized", "plain write"), WRITE_CUH,
             "kByProduct ? fmaf(n, r, kRoundMagic) : rintf(n / scale) + kRoundMagic",
             "rintf(n / scale) + kRoundMagic", T_QUANT_WRITE,
             "int8 / int4: codes of the quotient (the earlier spec), not of the product with 1 / scale",
             focus="boundaries and int"),
    Mutation("quant-int-rounded-twice", "write", WRITE_ARCHS, ("quantized", "plain write"), WRITE_CUH,
             "kByProduct ? fmaf(n, r, kRoundMagic) :", "kByProduct ? __fadd_rn(__fmul_rn(n, r), kRoundMagic) :",
             T_QUANT_WRITE, "int8 / int4: the product rounded to fp32 before it rounds to a code (a quotient's "
             "exact ties then round to even)", focus="boundaries and int"),
    Mutation("quant-int-unsaturated", "write", WRITE_ARCHS, ("quantized", "plain write"), WRITE_CUH,
             "m[k] = fminf(c, kRoundMagic + top);", "m[k] = c;", T_QUANT_WRITE,
             "int8 / int4: codes past the top (a coarse subnormal scale) not saturated", focus="subnormal"),
    Mutation("quant-int-product-always", "write", WRITE_ARCHS, ("quantized", "plain write"), WRITE_CUH,
             "if (normal_reciprocal(r)) {", "if (!flat) {", T_QUANT_WRITE,
             "int8 / int4: the product also where 1 / scale overflows (a subnormal bf16 scale)", focus="subnormal"),
    Mutation("quant-e4m3-ties-up", "write", ("Sm70", "Sm75"), ("quantized", "rope"), FP8_CUH,
             "const uint32_t rounded = (mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20;",
             "const uint32_t rounded = (mag + 0x80000u) >> 20;", T_QUANT_WRITE,
             "the integer e4m3 encoder rounds ties away from zero, not to even", focus="fp8 and sm70"),
    Mutation("quant-gather-zero-dropped", "gather", ALL, ("quantized", "addressing"), DEQUANT_CUH,
             "for (int k = 0; k < 8; ++k) v[k] = __fadd_rn(__fmul_rn(c[k], scale), zero);",
             "for (int k = 0; k < 8; ++k) v[k] = __fmul_rn(c[k], scale);", T_QUANT_GATHER + T_QUANT_ATTENTION,
             "int8 / int4 dequantization (gather and attention tiles): the per-token zero is not added back",
             focus="int"),
    Mutation("dequant-e4m3-nan-unchecked", "gather", MMA_SYNC, ("quantized", "addressing"), DEQUANT_CUH,
             "if (__builtin_expect(nan_bytes != 0u || !(fabsf(wide) < INFINITY), 0)) {",
             "if (__builtin_expect(!(fabsf(wide) < INFINITY), 0)) {", T_QUANT_GATHER,
             "integer e4m3 decode (gather on every tag, Sm70-Sm80 attention tiles): a NaN code's vector stays on "
             "the common path, which reads 0x7F as 480", focus="nan_codes"),
    Mutation("dequant-e4m3-wide-scale-unchecked", "gather", MMA_SYNC, ("quantized", "addressing"), DEQUANT_CUH,
             "if (__builtin_expect(nan_bytes != 0u || !(fabsf(wide) < INFINITY), 0)) {",
             "if (__builtin_expect(nan_bytes != 0u, 0)) {", T_QUANT_GATHER,
             "integer e4m3 decode: a scale of 2^8 or more stays on the common path, whose scale x 2^120 is "
             "infinite (codes 0 -> NaN, others -> inf)", focus="nan_codes"),
    Mutation("dequant-int4-nibble-mask", "gather", MMA_SYNC, ("quantized", "addressing"), DEQUANT_CUH,
             "code_value(masked_or<0xFu, 0x4B000000u>(word", "code_value(masked_or<0x7u, 0x4B000000u>(word",
             T_QUANT_GATHER + T_QUANT_ATTENTION, "int4 decode (gather, Sm70-Sm80 attention tiles): a nibble's top bit "
             "dropped", focus="int4"),
    Mutation("volta-stream-load-offset", "write", ("Sm70", "Sm75"), ("plain write", "pipeline"), ARCH_CUH,
             "r = __ldg(reinterpret_cast<const int4*>(vp));", "r = __ldg(reinterpret_cast<const int4*>(vp) + 1);",
             T_WRITE + T_GATHER + T_ATTENTION,
             "Sm70-tag 16-byte streaming loads (write, gather, Volta/Turing attention tiles) read the next vector"),
    # ------------------------------------------------------------------ gather
    Mutation("gather-rows-past-total", "gather", WRITE_ARCHS, ("paged table", "guard"), GATHER_CUH,
             "if (t >= p.out_rows || t >= p.cu_kv_lens[p.batch]) return nullptr;",
             "if (t >= p.out_rows || t > p.cu_kv_lens[p.batch]) return nullptr;", T_GATHER,
             "out row cu_kv_lens[B] (past the last sequence) is written"),
    Mutation("gather-out-rows-bound", "gather", WRITE_ARCHS, ("paged table", "guard"), GATHER_CUH,
             "if (t >= p.out_rows || t >= p.cu_kv_lens[p.batch]) return nullptr;",
             "if (t >= p.cu_kv_lens[p.batch]) return nullptr;", T_GATHER + T_SWEEP,
             "an out shorter than cu_kv_lens[B] is written past its end (caught by a canary there)",
             focus="short"),
    Mutation("gather-starts-ignored", "gather", WRITE_ARCHS, ("paged table", "block pointers"), GATHER_CUH,
             "const int64_t pos = (p.starts ? p.starts[b] : 0) + (t - p.cu_kv_lens[b]);",
             "const int64_t pos = t - p.cu_kv_lens[b];", T_GATHER, "gather ignores starts"),
    Mutation("gather-negative-position", "gather", WRITE_ARCHS, ("paged table", "guard"), GATHER_CUH,
             "if (pos < 0 || pos > INT_MAX) return nullptr;", "if (pos > INT_MAX) return nullptr;",
             T_GATHER + T_SWEEP, "negative positions (starts < 0) read the table entry before the sequence's row",
             focus="skip or cover"),
    Mutation("gather-rope-first-order", "gather", WRITE_ARCHS, ("block pointers",), GATHER_CUH,
             "arch::store<T, N>(out + (first + r) * p.out_stride + canonical_column(rows.cache.row, stored), data[k]);",
             "arch::store<T, N>(out + (first + r) * p.out_stride + stored, data[k]);", T_GATHER,
             "rope-first rows are copied out unreordered (out must be latent first)", focus="block_pointers"),
    Mutation("read-block-list-bound", "gather", ALL, ("block pointers", "guard"), ADDRESS_CUH,
             "if (i >= cache.cu_block_nums[b + 1] - first) return nullptr;",
             "if (i > cache.cu_block_nums[b + 1] - first) return nullptr;", T_GATHER + T_GUARDS,
             "block-pointer reads one block past a sequence's list use the next sequence's first block",
             focus="skip or past"),
    Mutation("read-table-width", "gather", ALL, ("paged table", "guard"), ADDRESS_CUH,
             "if (i >= max_blocks) return nullptr;", "if (i > max_blocks) return nullptr;", T_GATHER + T_GUARDS,
             "paged reads one entry past a block-table row use the next row's first block",
             focus="skip or past"),
    Mutation("sequence-of-boundary", "gather", WRITE_ARCHS, ("addressing", "block pointers"), ADDRESS_CUH,
             "if (cu_lens[mid] <= t) lo = mid; else hi = mid - 1;", "if (cu_lens[mid] < t) lo = mid; else hi = mid - 1;",
             T_GATHER + T_WRITE, "a sequence's first packed row is looked up in the previous sequence"),
    # ------------------------------------------------------------------ attention (shared, mma.sync kernel)
    Mutation("causal-own-token", "attention", ALL, ("mask", "decode", "prefill"), COMMON_CUH,
             "limit = min(w.kv_hi, p.causal ? w.kv_len - w.q_len + s + 1 : w.kv_len);",
             "limit = min(w.kv_hi, p.causal ? w.kv_len - w.q_len + s : w.kv_len);", T_ATTENTION,
             "causal limit off by one: a query does not see its own key"),
    Mutation("causal-cta-range", "attention", ALL, ("mask", "decode", "prefill"), COMMON_CUH,
             "const int visible = p.causal ? w.kv_len - w.q_len + last_row / p.num_heads + 1 : w.kv_len;",
             "const int visible = p.causal ? w.kv_len - w.q_len + last_row / p.num_heads : w.kv_len;", T_ATTENTION,
             "a CTA's kv range stops one key before its last query's own key"),
    Mutation("mma-sync-mask-one-past", "attention", MMA_SYNC, ("mask", "softmax"), COMMON_CUH,
             "sc[c] = (j0 + my_col0 + c < row_limit && ((valid >> c) & 1)) ? sc[c] * scale_log2 : -INFINITY;",
             "sc[c] = (j0 + my_col0 + c <= row_limit && ((valid >> c) & 1)) ? sc[c] * scale_log2 : -INFINITY;",
             T_ATTENTION + T_EXPANDED, "mma.sync kernels (online_softmax_tile, the expanded kernel's too): the key "
             "at a row's limit (next token, or a zero row past the end) is scored"),
    Mutation("mma-sync-scale-not-log2", "attention", MMA_SYNC, ("softmax",), MMA_SYNC_CUH,
             "const float scale_log2 = p.softmax_scale * kLog2e;", "const float scale_log2 = p.softmax_scale;",
             T_ATTENTION, "mma.sync kernel: exp2 of scores scaled for exp (softmax temperature x1.44)"),
    Mutation("rescale-factor-inverted", "attention", ALL, ("rescale", "softmax"), COMMON_CUH,
             "return kFlushDenormals ? arch::exp2_ftz(old_max - new_max) : exp2f(old_max - new_max);",
             "return kFlushDenormals ? arch::exp2_ftz(new_max - old_max) : exp2f(new_max - old_max);", T_ATTENTION,
             "online softmax rescale factor 2^(new - old): infinite on the first tile, 0 x inf = NaN"),
    Mutation("mma-sync-row-sum-not-rescaled", "attention", MMA_SYNC, ("rescale",), COMMON_CUH,
             "row_sum = row_sum * alpha + tile_sum;", "row_sum = row_sum + tile_sum;",
             T_SCORES + T_ATTENTION + T_EXPANDED, "mma.sync kernels (online_softmax_tile, the expanded kernel's "
             "too): the row sum keeps its old scale when the running max moves (score jump)", focus=RESCALE_FOCUS),
    Mutation("mma-sync-lse-base", "attention", MMA_SYNC, ("lse",), MMA_SYNC_CUH,
             "const float lse = l > 0.f ? (max_s[tid] + log2f(l)) * kLn2 : -INFINITY;",
             "const float lse = l > 0.f ? (max_s[tid] + logf(l)) * kLn2 : -INFINITY;", T_ATTENTION,
             "mma.sync kernel: lse adds ln(sum) to a log2-domain max"),
    Mutation("decode-ctas-per-sequence", "attention", ALL, ("decode",), COMMON_CUH,
             "const int per_seq = (p.q_len * p.num_heads + kBlockM - 1) / kBlockM;",
             "const int per_seq = p.q_len * p.num_heads / kBlockM;", T_ATTENTION,
             "decode: CTAs per sequence rounded down (a sequence's last, partial CTA is lost)"),
    Mutation("prefill-ctas-per-sequence", "attention", ALL, ("prefill",), COMMON_CUH,
             "n = ((p.cu_q_lens[b + 1] - p.cu_q_lens[b]) * p.num_heads + kBlockM - 1) / kBlockM;",
             "n = (p.cu_q_lens[b + 1] - p.cu_q_lens[b]) * p.num_heads / kBlockM;", T_ATTENTION,
             "packed prefill: CTAs per sequence rounded down (rows of its last CTA never written)",
             focus="prefill"),
    Mutation("split-range-short", "attention", ALL, ("split",), COMMON_CUH,
             "w.kv_hi = min(min(w.kv_lo + p.tokens_per_split, w.kv_len), visible);",
             "w.kv_hi = min(min(w.kv_lo + p.tokens_per_split - 1, w.kv_len), visible);", T_ATTENTION,
             "a split's kv range drops its last position"),
    Mutation("tiles-ignore-block-limit", "schedule", MMA_SYNC, ("dispatch",), ATTENTION_CU,
             "if (c.block_m != block_m || bytes > l.per_block || resident(bytes, c.max_ctas_per_sm) == 0) continue;",
             "if (c.block_m != block_m || resident(bytes / 2, c.max_ctas_per_sm) == 0) continue;",
             ("tests/test_gpu_limits.py",),
             "the tile choice ignores the per-CTA limit: a 163 KB A100 tile on a 99 KB L40, a V100 tile on a T4",
             focus="configuration or limits"),
    Mutation("tiles-ctas-per-sm-unbounded", "schedule", MMA_SYNC, ("split",), ATTENTION_CU,
             "return std::max(0, std::min(most, l.per_sm / (bytes + l.reserved_per_block)));",
             "return most;", ("tests/test_gpu_limits.py", "tests/test_cpp_api.py"),
             "the schedule counts two 16-row Sm80 CTAs per SM on an A100, which holds one: a second wave",
             focus="ctas"),
    # ------------------------------------------------------------------ arch: mma.sync paths and tile pipelines
    Mutation("sm70-mma-a-register-order", "attention", ("Sm70",), ("mma",), MMA_CUH,
             ': "r"(a.r[k][0]), "r"(a.r[k][1]), "r"(b.r[k][0]), "r"(b.r[k][1]));',
             ': "r"(a.r[k][1]), "r"(a.r[k][0]), "r"(b.r[k][0]), "r"(b.r[k][1]));', T_ATTENTION,
             "mma.m8n8k4: A's two f16x2 registers swapped (k 0-1 against B's k 2-3)"),
    Mutation("sm75-mma-b-k-half", "attention", ("Sm75",), ("mma",), MMA_CUH,
             ': "r"(a.r[2 * k]), "r"(a.r[2 * k + 1]), "r"(b.r[h][k]));',
             ': "r"(a.r[2 * k]), "r"(a.r[2 * k + 1]), "r"(b.r[h][0]));', T_ATTENTION,
             "mma.m16n8k8: both k halves multiply B's first k half"),
    Mutation("sm80-bf16-mma-b-order", "attention", ("Sm80",), ("mma",), MMA_CUH,
             ': "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[h][0]), "r"(b.r[h][1]));',
             ': "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[h][1]), "r"(b.r[h][0]));', T_ATTENTION,
             "mma.m16n8k16 bf16: B's two k-half registers swapped", occurrence=1),
    Mutation("sm80-cp-async-lookahead", "attention", ("Sm80",), ("pipeline", "cp.async"), MMA_SYNC_CUH,
             "lookup(j0 + (kStages + 1) * kBlockN);", "lookup(j0 + kStages * kBlockN);", T_ATTENTION,
             "cp.async ring: the refill after the next one looks up the same tile again"),
    Mutation("register-staging-lookahead", "attention", ("Sm70", "Sm75"), ("pipeline",), MMA_SYNC_CUH,
             "lookup(j0 + 2 * kBlockN);", "lookup(j0 + kBlockN);", T_ATTENTION,
             "Volta/Turing register staging: the tile after next gets the next tile's rows"),
    # ------------------------------------------------------------------ Sm90 wgmma kernel
    Mutation("sm90-dequant-ds-tile-scale", "attention", ("Sm90",), ("quantized",), SM90_CUH,
             "auto scale_of = [&](float2 s, int c) { return F == KvFormat::kFp8DsMla && c >= 2 ? s.y : s.x; };",
             "auto scale_of = [&](float2 s, int c) { return s.x; };", T_QUANT_ATTENTION,
             "Hopper dequant: fp8_ds_mla's second latent tile of a half takes the first one's scale",
             focus="fp8_ds_mla"),
    Mutation("sm90-dequant-rope-latent-first", "attention", ("Sm90",), ("quantized", "block pointers"), SM90_CUH,
             "const int e = stored_column(layout, kLatentDim);", "const int e = kLatentDim;", T_QUANT_ATTENTION,
             "Hopper dequant: rope-first block-pointer rows' rope read at the latent-first offset",
             focus="blocks"),
    Mutation("sm90-mask-one-past", "attention", ("Sm90",), ("mask", "softmax"), SM90_CUH,
             "x = j + 8 * jj + 2 * (lane % 4) + e < row_limit[hh] && ((valid >> (8 * jj + e)) & 1) ? x * scale_log2",
             "x = j + 8 * jj + 2 * (lane % 4) + e <= row_limit[hh] && ((valid >> (8 * jj + e)) & 1) ? x * scale_log2",
             T_ATTENTION,
             "wgmma kernel: the key at a row's limit is scored"),
    Mutation("sm90-lse-units", "attention", ("Sm90",), ("lse",), SM90_CUH,
             "const float lse = l > 0.f ? (row_max[hh] + log2f(l)) * kLn2 : -INFINITY;",
             "const float lse = l > 0.f ? row_max[hh] * kLn2 + log2f(l) : -INFINITY;", T_ATTENTION,
             "wgmma kernel: lse adds log2(sum) unconverted"),
    Mutation("sm90-swizzle-phase", "attention", ("Sm90",), ("mma",), WGMMA_CUH,
             "return row * kSwizzleRowBytes + ((unit ^ (row & 7)) << 4);",
             "return row * kSwizzleRowBytes + ((unit ^ (row & 3)) << 4);", T_ATTENTION,
             "128-byte swizzle with a 4-row phase: Q and cp.async tiles land where wgmma does not read them"),
    Mutation("sm90-scores-first-k-step", "attention", ("Sm90",), ("mma",), SM90_CUH,
             "Qk::mma(sc, arch::desc_advance(q_desc, off), arch::desc_advance(k_desc, off), i + k > 0);",
             "Qk::mma(sc, arch::desc_advance(q_desc, off), arch::desc_advance(k_desc, off), i + k > 1);", T_ATTENTION,
             "Q.K^T: the second k step overwrites the first instead of accumulating"),
    Mutation("sm90-row-sum-one-warpgroup", "attention", ("Sm90",), ("softmax", "decode", "prefill"), SM90_CUH,
             "const float l = sum_s[r] + sum_s[kRows + r];", "const float l = sum_s[r];", T_ATTENTION,
             "wgmma kernel: rows normalized by warpgroup 0's sum alone (wrong past 64 keys)"),
    Mutation("sm90-tiles-rounded-down", "attention", ("Sm90",), ("decode", "prefill"), SM90_CUH,
             "return w.kv_hi > w.kv_lo ? (w.kv_hi - w.kv_lo + kTokens - 1) / kTokens : 0;",
             "return w.kv_hi > w.kv_lo ? (w.kv_hi - w.kv_lo) / kTokens : 0;", T_ATTENTION,
             "wgmma kernel: a partial last tile of 64 keys is skipped"),
    Mutation("sm90-zero-tail-skipped", "attention", ("Sm90",), ("TMA", "decode"), SM90_CUH,
             "if (valid < kTokens) {", "if (valid < 0) {", T_ATTENTION + T_GUARDS,
             "TMA path: rows past the sequence end keep their bytes in V (NaN there reaches out as 0 x NaN)",
             focus="nan or block_sizes"),
    Mutation("sm90-tma-next-tile-blocks", "attention", ("Sm90",), ("TMA", "paged table"), SM90_CUH,
             "if (t + 1 < tiles) tile_blocks(rows, w.b, first + kTokens, blocks);",
             "if (t + 1 < tiles) tile_blocks(rows, w.b, first + 2 * kTokens, blocks);", T_ATTENTION,
             "TMA copy thread: every tile after the first is read from the blocks of the tile after it"),
    Mutation("sm90-cp-async-rope-first", "attention", ("Sm90",), ("cp.async", "block pointers"), SM90_CUH,
             "const int src_col = stored_column(rows.cache.row, chunk * 64) + unit * 8;",
             "const int src_col = chunk * 64 + unit * 8;", T_ATTENTION,
             "cp.async path: rope-first block-pointer rows read as if latent first", focus="block_pointers"),
    Mutation("sm90-adopt-own-max", "attention", ("Sm90",), ("rescale",), SM90_CUH,
             "adopt_max(1, alpha);", "adopt_max(0, alpha);", T_SCORES + T_ATTENTION,
             "seesaw: warpgroup 0 re-reads its own max instead of warpgroup 1's (wrong after a score jump "
             "in a pair's second tile)", focus=RESCALE_FOCUS),
    # ------------------------------------------------------------------ Hopper narrow decode (every quantized format)
    Mutation("narrow-copy-window-not-ahead", "attention", ("Sm90",), ("quantized", "decode", "paged table"), NARROW_CUH,
             "ahead = tile_block(t + 32 + lane);", "ahead = tile_block(t + lane);", T_QUANT_ATTENTION,
             "narrow kernel's copy warp, tiles in one block each: past 64 tiles the window holds the bases it "
             "already used, so tiles 64 .. 95 are copied from the blocks of tiles 32 .. 63", focus="windows"),
    Mutation("narrow-copy-block-of-tile-zero", "attention", ("Sm90",), ("quantized", "decode", "paged table"), NARROW_CUH,
             "const char* base = lane_pointer(window, t % 32);", "const char* base = lane_pointer(window, 0);",
             T_QUANT_ATTENTION, "narrow kernel's copy warp, tiles in one block each: every tile of a window read "
             "from its first tile's block (rows at the right offsets, the wrong block)", focus="bs64 or windows"),
    Mutation("narrow-pair-first-half-only", "attention", ("Sm90",), ("quantized", "decode", "split"), NARROW_CUH,
             "feature = int(rank) * kHalf + 4 * (i % kChunks);", "feature = 4 * (i % kChunks);", T_QUANT_ATTENTION,
             "narrow kernel, clusters of two splits: both CTAs merge and write features 0 .. 255, so features "
             "256 .. 511 of out are never written", focus="pairs"),
    Mutation("narrow-pair-own-lse", "attention", ("Sm90",), ("quantized", "decode", "split", "lse"), NARROW_CUH,
             "lb = arch::load_cluster_shared_f32(lse_s + col, other);", "lb = la;", T_QUANT_ATTENTION,
             "narrow kernel, clusters of two splits: the other CTA's lse taken as this one's, so the two "
             "splits' rows are averaged instead of weighted by their softmax mass", focus="pairs"),
    Mutation("narrow-pair-combine-every-split", "combine", ("Sm90",), ("quantized", "decode", "split"),
             ATTENTION_CU, "(p.num_splits > 1 && !l.pair_merge)", "(p.num_splits > 1)",
             T_QUANT_ATTENTION, "narrow kernel, clusters of two splits: the combine runs after the pair wrote "
             "out, merging the two partials no CTA wrote (the workspace's poison) over it", focus="pairs"),
    Mutation("narrow-q-power-dropped", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "score_scale_s[n] = kScaledQ ? ldexpf(scale_log2, q_exp) : scale_log2;",
             "score_scale_s[n] = scale_log2;", T_QUANT_ATTENTION,
             "narrow kernel, fp8 with bf16 q: a q row's power of two is not put back into its scores",
             focus="beyond"),
    Mutation("narrow-q-rope-units-dropped", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "const bool here = src != nullptr && unit < kUnits;", "const bool here = src != nullptr && unit < 32;",
             T_QUANT_ATTENTION, "narrow kernel: Q^T's units 32-35 (q's rope features, a lane's second unit) left zero",
             focus="narrow"),
    Mutation("narrow-q-power-latent-only", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "amax = fmaxf(amax, fmaxf(fabsf(arch::to_float(v.v[0])), fabsf(arch::to_float(v.v[1]))));",
             "if (h == 0) amax = fmaxf(amax, fmaxf(fabsf(arch::to_float(v.v[0])), fabsf(arch::to_float(v.v[1]))));",
             T_QUANT_ATTENTION, "narrow kernel, bf16 q: a q row's power of two from its latent features alone (a "
             "lane's first unit), so a row led by its rope part overflows fp16", focus="rope_part_leads"),
    Mutation("narrow-zero-score-dropped", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "if constexpr (kZeros) x = row_scale[h] * (x - qbias) + row_zero[h] * qsum;",
             "if constexpr (kZeros) x = row_scale[h] * (x - qbias);", T_QUANT_ATTENTION,
             "narrow kernel, int8 / int4: scores miss the zero point's z sum(q)", focus="int"),
    Mutation("narrow-zero-output-dropped", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "corr_add[q] = pr[0] * row_zero[0] + pr[1] * row_zero[1];", "corr_add[q] = 0.f;",
             T_QUANT_ATTENTION, "narrow kernel, int8 / int4: the output misses sum_t P z_t", focus="int"),
    Mutation("narrow-code-bias-in-scores", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "x = row_scale[h] * (x - qbias) + row_zero[h] * qsum;", "x = row_scale[h] * x + row_zero[h] * qsum;",
             T_QUANT_ATTENTION, "narrow kernel, int8 / int4: the scores keep the biased codes' 1024", focus="int"),
    Mutation("narrow-int4-bias-all-features", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "if (F == KvFormat::kInt8 || high) biased += pair;", "biased += pair;", T_QUANT_ATTENTION,
             "narrow kernel, int4: the scores' bias counted over every feature's q, not the high nibbles' alone",
             focus="int4"),
    Mutation("narrow-int4-q-unscaled", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "for (int k = 1; k < 8; k += 2) words[k] = times_halves(words[k], sixteenth);",
             "for (int k = 9; k < 8; k += 2) words[k] = times_halves(words[k], sixteenth);", T_QUANT_ATTENTION,
             "narrow kernel, int4: the high nibbles' q not divided by 16 (their codes enter as 1024 + 16 c)",
             focus="int4"),
    Mutation("narrow-int4-high-unscaled", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "return Fmt::kBiasSum && high ? (x - bias) * 0.0625f : x;", "return Fmt::kBiasSum && high ? (x - bias) : x;",
             T_QUANT_ATTENTION, "narrow kernel, int4: the high nibbles' output columns keep the codes' 16",
             focus="int4"),
    Mutation("narrow-bias-sum-units", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "psum_add[q] = scale_up * (", "psum_add[q] = (", T_QUANT_ATTENTION,
             "narrow kernel, int8 / int4: the output's bias sum in units of 2^sigma instead of true units",
             focus="int"),
    Mutation("narrow-p-shift-in-lse", "attention", ("Sm90",), ("quantized", "lse"), NARROW_CUH,
             "(merged_max[q] - Fmt::kPShift + log2f(l)) * kLn2", "(merged_max[q] + log2f(l)) * kLn2",
             T_QUANT_ATTENTION, "narrow kernel, fp8: lse keeps P's 2^7", focus="fp8"),
    Mutation("narrow-run-last-row", "attention", ("Sm90",), ("quantized", "paged table"), NARROW_CUH,
             "hi[k] = block_runs ? min(block0 + (r + 1) * per_block, end) : min(lo[k] + 1, end);",
             "hi[k] = block_runs ? min(block0 + (r + 1) * per_block - 1, end) : min(lo[k] + 1, end);",
             T_QUANT_ATTENTION, "narrow kernel's copy warp: each block run leaves its last row behind"),
    Mutation("narrow-rescale-first-tile-only", "attention", ("Sm90",), ("quantized", "rescale"), NARROW_CUH,
             "if (f != 1.f) {", "if (f == 0.f) {", T_QUANT_ATTENTION,
             "narrow kernel: O is rescaled when the first tile sets the max, not when a later one moves it",
             focus="jumps"),
    Mutation("narrow-scale-rise-kept", "attention", ("Sm90",), ("quantized", "rescale"), NARROW_CUH,
             "grow = ldexpf(1.f, sigma_run - sigma);", "grow = 1.f;", T_QUANT_ATTENTION,
             "narrow kernel, int8 / int4: O is not rescaled when a tile's scales raise the power of two "
             "P s_t enters the products under", focus="scale_rise"),
    Mutation("narrow-vote-first-warp", "attention", ("Sm90",), ("quantized", "rescale"), NARROW_CUH,
             "if (vote.x | vote.y | vote.z | vote.w) {", "if (vote.x) {", T_QUANT_ATTENTION,
             "narrow kernel: only warp 0's tokens can move the running max (a later tile's jump in another "
             "warp's tokens overflows P)", focus="jumps"),
    Mutation("narrow-merge-one-warpgroup", "attention", ("Sm90",), ("quantized", "softmax"), NARROW_CUH,
             "total_l[q] += l * fk;", "total_l[q] += k == 0 ? l * fk : 0.f;", T_QUANT_ATTENTION,
             "narrow kernel: rows normalized by warpgroup 0's sum alone (wrong past 64 keys)"),
    Mutation("narrow-ds-rope-unguarded", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "rope_down[h] = ldexpf(1.f, -max(scale_exponent(amax) - 15, kMinScaleExponent));",
             "rope_down[h] = ldexpf(1.f, -sigma);", T_QUANT_ATTENTION,
             "narrow kernel, fp8_ds_mla: the rope enters under the latent's power of two, and overflows fp16 "
             "where the tile scales are far below it", focus="rope"),
    Mutation("narrow-ds-v-first-tile", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "fv = *reinterpret_cast<const uint2*>(factors + ((wq * 4 + s) * 4 + c) * 4);",
             "fv = *reinterpret_cast<const uint2*>(factors + ((0 * 4 + s) * 4 + c) * 4);", T_QUANT_ATTENTION,
             "narrow kernel, fp8_ds_mla: every output column scaled by its token's first tile scale",
             focus="fp8_ds_mla"),
    Mutation("narrow-ds-k-first-tile", "attention", ("Sm90",), ("quantized", "decode"), NARROW_CUH,
             "fold(tile_sc[tile % 2], row_scales(0)[tile], row_scales(1)[tile]);",
             "fold(tile_sc[tile % 2], row_scales(0)[0], row_scales(1)[0]);", T_QUANT_ATTENTION,
             "narrow kernel, fp8_ds_mla: every latent feature's score scaled by its token's first tile scale",
             focus="fp8_ds_mla"),
    # ------------------------------------------------------------------ expanded-form kernel (Sm70 / Sm75)
    Mutation("expanded-causal-one-late", "expanded", ("Sm70", "Sm75"), ("mask", "prefill"), EXPANDED_CUH,
             "row_limit = p.causal ? min(w.kv_hi, w.k_len - w.q_len + w.row0 + my_row + 1) : w.kv_hi;",
             "row_limit = p.causal ? min(w.kv_hi, w.k_len - w.q_len + w.row0 + my_row + 2) : w.kv_hi;", T_EXPANDED,
             "expanded_attention: each causal query also sees the key after its own"),
    Mutation("expanded-rescale-skipped", "expanded", MMA_SYNC, ("rescale",), COMMON_CUH,
             "return __syncthreads_or(alpha != 1.f);", "return __syncthreads_or(alpha != 1.f) && false;",
             T_EXPANDED + T_SCORES + T_ATTENTION, "online_softmax_tile (expanded_attention, and the mma.sync "
             "attention kernel): O is not rescaled when the running max moves", focus=RESCALE_FOCUS + " or sink"),
    Mutation("expanded-lse-log2", "expanded", ("Sm70", "Sm75"), ("lse",), EXPANDED_CUH,
             "l > 0.f ? (max_s[tid] + log2f(l)) * kLn2 : -INFINITY;", "l > 0.f ? (max_s[tid] + log2f(l)) : -INFINITY;",
             T_EXPANDED, "expanded_attention: lse left in the log2 domain"),
    Mutation("expanded-split-k-slice-dropped", "expanded", MMA_SYNC, ("mma",), COMMON_CUH,
             "for (int part = 0; part < Tiles::kSplitK; ++part)", "for (int part = 0; part < 1; ++part)",
             T_EXPANDED + T_ATTENTION, "online_softmax_tile sums only the first slice's partial scores: "
             "expanded_attention's 32-row CTAs (Sm75 at 256 / 256, T4 limits) drop the second half of d_qk, the "
             "mma.sync attention tiles that split the 576-d contraction lose the other slices"),
    Mutation("expanded-q-head-stride", "expanded", ("Sm70", "Sm75"), ("addressing",), EXPANDED_CUH,
             "w.q_base * p.q_stride_t + int64_t(w.h) * p.q_stride_h;", "w.q_base * p.q_stride_t + int64_t(w.h) * p.k_stride_h;",
             T_EXPANDED, "expanded_attention: q's heads addressed with k's head stride (equal when both are dense)"),
    # ------------------------------------------------------------------ split-KV combine
    Mutation("combine-few-lse", "combine", ALL, ("split", "lse"), COMBINE_CU,
             "denom > 0.f ? m + logf(denom) : -INFINITY;", "denom > 0.f ? m : -INFINITY;", T_ATTENTION,
             "combine of <= 8 splits: merged lse is the largest split's, without log(sum of weights)",
             occurrence=2),
    Mutation("combine-many-unweighted", "combine", ALL, ("split",), COMBINE_CU,
             "o[g].x += wgt * x[u][g].x;", "o[g].x += x[u][g].x;", T_ATTENTION + T_SCORES,
             "combine of > 8 splits: even columns summed without the split weights", occurrence=1,
             focus="split"),
    Mutation("combine-many-padded-row", "combine", ALL, ("split", "prefill", "guard"), COMBINE_CU,
             "if (p.cu_q_lens != nullptr && flat >= int64_t(p.cu_q_lens[p.batch]) * p.num_heads) return;",
             "if (p.cu_q_lens != nullptr && flat > int64_t(p.cu_q_lens[p.batch]) * p.num_heads) return;",
             T_ATTENTION, "combine of > 8 splits writes the first padded row past cu_q_lens[B]",
             occurrence=1, focus="padded"),
    Mutation("combine-many-reads-before-grid-done", "combine", ("Sm90",), ("split", "decode"), COMBINE_CU,
             "arch::wait_for_prior_grid();  // the partials come from the attention grid (CombineLaunch::kEarly)",
             "// (no wait for the attention grid)", T_QUANT_ATTENTION + T_ATTENTION,
             "combine of > 8 splits, launched early after a Hopper kernel: reads partials before that grid ends",
             focus="graph or splits40"),
    Mutation("combine-few-reads-before-grid-done", "combine", ("Sm90",), ("split", "decode"), COMBINE_CU,
             "arch::wait_for_prior_grid();  // as in combine_splits_kernel", "// (no wait for the attention grid)",
             T_QUANT_ATTENTION + T_ATTENTION,
             "combine of <= 8 splits, launched early after a Hopper kernel: reads partials before that grid ends",
             focus="graph or combine"),
    # ------------------------------------------------------------------ schedule
    Mutation("schedule-split-off-tile", "schedule", ALL, ("split",), ATTENTION_CU,
             "tokens = ceil_div(tokens, kTileTokens) * kTileTokens;", "tokens = ceil_div(tokens, 32) * 32;",
             ("tests/test_cpp_api.py",) + T_ATTENTION,
             "splits end on 32-token, not 64-token tile boundaries", focus="schedule"),
    Mutation("schedule-empty-splits", "schedule", ALL, ("split",), ATTENTION_CU,
             "return {ceil_div(std::max<int64_t>(max_kv_len, 1), tokens), tokens, tiles};",
             "return {splits, tokens, tiles};",
             ("tests/test_cpp_api.py",) + T_ATTENTION,
             "the split count is not recomputed after rounding tokens up: trailing splits are empty",
             focus="schedule"),
    Mutation("plan-piece-end-off-by-one", "schedule", ALL, ("split",), PLAN_CU,
             "const int kv_hi = min((i + 1) * piece_tiles * kTileTokens, w.visible);",
             "const int kv_hi = min((i + 1) * piece_tiles * kTileTokens - 1, w.visible);", T_PLAN + T_ATTENTION,
             "length-aware plan: every piece but a unit's last ends one key early (its last key read by no CTA)",
             focus="plan"),
    Mutation("plan-combine-lost-partial", "schedule", ALL, ("split",), COMBINE_CU,
             "c.splits = u.splits;", "c.splits = u.splits - 1;", T_PLAN + T_ATTENTION,
             "length-aware plan: the combine merges a split unit's pieces but its last", focus="plan"),
    Mutation("plan-causal-visible-whole-sequence", "schedule", ALL, ("split", "mask"), PLAN_CU,
             "w.visible = p.causal ? min(w.kv_len, max(0, w.kv_len - q + last / p.num_heads + 1)) : w.kv_len;",
             "w.visible = p.causal ? min(w.kv_len, max(0, w.kv_len - q + last / p.num_heads)) : w.kv_len;",
             T_PLAN + T_ATTENTION, "length-aware plan: a unit's kv range stops one key short of its last row's",
             focus="plan"),
    Mutation("plan-slot-prefix-misses-splits", "schedule", ALL, ("split",), PLAN_CU,
             "const int slot0 = at[0] - (run.first + k) + at[1];", "const int slot0 = at[0] - (run.first + k);",
             T_PLAN + T_ATTENTION, "length-aware plan: a split unit's first slot leaves out one per earlier split "
             "unit, so the second split unit's partials overwrite the first one's last", focus="plan"),
    Mutation("plan-split-groups-too-wide", "schedule", ALL, ("split",), PLAN_CU,
             "const int shift = 31 - __clz(kPlanThreads / records);",
             "const int shift = 32 - __clz(kPlanThreads / records);", T_PLAN + T_ATTENTION,
             "length-aware plan: twice as many threads per split unit as the CTA has for them, so of two or more "
             "split units in a round about half get no items and no combine rows", focus="plan"),
    Mutation("plan-packed-unit-search-strict", "schedule", ALL, ("split", "prefill"), PLAN_CU,
             "if (c < p.batch && batch.first_unit[c] <= u[k]) b[k] = c;",
             "if (c < p.batch && batch.first_unit[c] < u[k]) b[k] = c;", T_PLAN + T_ATTENTION,
             "length-aware plan, packed batch: a sequence's first unit is taken for one past the previous "
             "sequence's last (a row block before row 0)", focus="plan and prefill"),
    # ------------------------------------------------------------------ sparse attention
    Mutation("index-scores-relu-dropped", "indexer", INDEX_SCORES_ARCHS, ("index scores", "mma"), INDEX_SCORES_CUH,
             "float v = fmaxf(acc[m][n][i], 0.f) * weight[m][i]", "float v = acc[m][n][i] * weight[m][i]",
             T_INDEX_SCORES, "index scores: a head's negative dot product is added instead of clipped at 0",
             focus="decode and fp16"),
    Mutation("index-scores-causal-off-by-one", "indexer", INDEX_SCORES_ARCHS, ("index scores", "mask"),
             INDEX_SCORES_CUH, "pos <= pos_of_first + j ?", "pos < pos_of_first + j ?", T_INDEX_SCORES,
             "index scores: a token's own key (written before its scores) is left out", focus="prefill"),
    Mutation("index-scores-scale-parity", "indexer", INDEX_SCORES_ARCHS, ("index scores", "pipeline"),
             INDEX_SCORES_CUH, "sum * s.key_scale[tile & 1][n]", "sum * s.key_scale[(tile + 1) & 1][n]",
             T_INDEX_SCORES, "index scores: a tile's logits take the other tile's key scales", focus="decode"),
    Mutation("index-scores-bf16-factor", "indexer", INDEX_SCORES_ARCHS, ("index scores", "quantized"),
             INDEX_SCORES_CUH, "if constexpr (kQ == kQBf16) w *= factor;", "if constexpr (kQ == kQBf16) w *= 1.f;",
             T_INDEX_SCORES, "index scores: bf16 rows scaled into fp16 range are not scaled back", focus="bf16"),
    Mutation("index-scores-scales-interleaved", "indexer", INDEX_SCORES_ARCHS, ("index scores", "addressing"),
             INDEX_SCORES_CUH, "int64_t(cache.page_size) * kIndexDim + offset * 4", "offset * kIndexRowBytes + kIndexDim",
             T_INDEX_SCORES, "index scores: a token's scale read after its own 128 codes (a [128 | 4] row) instead "
             "of after the page's codes", focus="decode"),
    Mutation("index-scores-ring-slot", "indexer", ("Sm80",), ("index scores", "cp.async"), INDEX_SCORES_CUH,
             "s.codes[tile % kStages] + pos", "s.codes[(tile + 1) % kStages] + pos", T_INDEX_SCORES,
             "index scores (cp.async ring): a tile is widened from the next tile's ring slot (codes landed or not, "
             "never written in a one-tile chunk)", focus="decode"),
    Mutation("index-scores-ring-scale-slot", "indexer", ("Sm80",), ("index scores", "cp.async"), INDEX_SCORES_CUH,
             "s.scales[tile % kStages][tid]", "s.scales[(tile + 2) % kStages][tid]", T_INDEX_SCORES,
             "index scores (cp.async ring): a tile's key scales come from the previous tile's ring slot, refilled "
             "with a later tile's", focus="decode"),
    Mutation("index-topk-ties-later-chunks-first", "indexer", ALL, ("index topk", "split"), INDEX_TOPK_CUH,
             "if (splits > 1 && tid < split) {", "if (splits > 1 && tid > split && tid < splits) {", T_INDEX_TOPK,
             "index top-k: a split row's CTAs rank their tied keys after the later chunks', so ties prefer the "
             "larger position", focus="ties"),
    Mutation("index-topk-bucket-off-by-one", "indexer", ALL, ("index topk", "guard"), INDEX_TOPK_CUH,
             "prefix = (prefix << digit_bits(round)) | uint32_t(found_s[0]);",
             "prefix = (prefix << digit_bits(round)) | uint32_t(found_s[0] + 1);", T_INDEX_TOPK,
             "index top-k: the threshold digit one bucket above the k-th key's, leaving part of the row unwritten",
             focus="matches_reference"),
    Mutation("index-topk-decode-sees-next-position", "indexer", ALL, ("index topk", "mask", "decode"),
             INDEX_TOPK_CUH, "last = int64_t(p.kv_lens[seq]) - 1;", "last = int64_t(p.kv_lens[seq]);", T_INDEX_TOPK,
             "index top-k: a decode token also sees the position after its own", focus="matches_reference"),
    Mutation("index-topk-slot-next-page", "indexer", ALL, ("index topk", "paged slots"), INDEX_TOPK_CUH,
             "const int block = p.block_table[int64_t(seq) * p.block_table_stride + column];",
             "const int block = p.block_table[int64_t(seq) * p.block_table_stride + column + 1];", T_INDEX_TOPK,
             "index top-k: a position's slot taken from the next page's block", focus="slots"),
    Mutation("index-topk-histograms-left-dirty", "indexer", ALL, ("index topk", "split"), INDEX_TOPK_CUH,
             "for (int64_t w = tid; w < words; w += kThreads) state[kCounterWords + w] = 0;",
             "for (int64_t w = tid; w < kHistWords / 2; w += kThreads) state[kCounterWords + w] = 0;", T_INDEX_TOPK,
             "index top-k: a split row's last histograms are not reset, so the next launch (a graph replay) adds "
             "to them", focus="workspace or graph"),
    Mutation("sparse-mask-ignored", "attention", MMA_SYNC, ("sparse", "mask"), COMMON_CUH,
             "(j0 + my_col0 + c < row_limit && ((valid >> c) & 1))", "(j0 + my_col0 + c < row_limit && ((valid >> c) | 1))",
             T_SPARSE, "sparse attention: a missing row (-1, outside the cache) scores 0 instead of leaving the softmax",
             focus="pad or range"),
    Mutation("sparse-mask-slot-shifted", "attention", MMA_SYNC, ("sparse", "mask", "pipeline"), MMA_SYNC_CUH,
             "valid_s[(next_tile & 3) * kLookups + i] = next_valid[i];",
             "valid_s[((next_tile + 1) & 3) * kLookups + i] = next_valid[i];", T_SPARSE,
             "sparse attention: a tile's row bits land in the next tile's slot", focus="pad"),
    Mutation("sparse-sm90-mask-slot", "attention", ("Sm90",), ("sparse", "mask"), SM90_CUH,
             "(valid_s + 4 * (((j - w.kv_lo) / kTokens) % kValidSlots))",
             "(valid_s + 4 * (((j - w.kv_lo) / kTokens + 1) % kValidSlots))", T_SPARSE,
             "Hopper sparse attention: the softmax reads another tile's row bits", focus="pad"),
    Mutation("sparse-sm90-quant-mask-rows", "attention", ("Sm90",), ("sparse", "mask", "quantized"), SM90_CUH,
             "if (thread % 32 == 0) valid_s[4 * (t % kValidSlots) + thread / 32] = uint16_t(bits);",
             "if (thread % 32 == 0) valid_s[4 * (t % kValidSlots) + (thread / 32 + 1) % 4] = uint16_t(bits);",
             T_SPARSE, "Hopper sparse attention over a quantized cache: each warp's row bits land on another "
             "warp's 16 rows", focus="quantized"),
    Mutation("sparse-slot-past-cache", "attention", ALL, ("sparse", "guard", "paged slots"), ADDRESS_CUH,
             "if (block >= cache.num_blocks) return {nullptr, 0};", "if (block > cache.num_blocks) return {nullptr, 0};",
             T_SPARSE, "sparse attention reads a slot of the block just past the cache as a row", focus="range"),
    Mutation("sparse-block-pointer-sequence", "attention", ALL, ("sparse", "block pointers"), ADDRESS_CUH,
             "const int b = sequence_of(cu_q_lens, cache.batch, t);",
             "const int b = sequence_of(cu_q_lens, cache.batch, t + 1);", T_SPARSE,
             "block-pointer sparse attention: a sequence's last token reads the next sequence's positions",
             focus="block_pointers"),
    # ------------------------------------------------------------------ index keys
    Mutation("index-keys-hadamard-stage-skipped", "indexer", WRITE_ARCHS, ("index keys", "quantized"), INDEX_KEYS_CUH,
             "  in_lane(8);", "  // (the butterflies over element bit 6 skipped)", T_INDEX_KEYS,
             "index keys and queries: the Hadamard's last stage (elements e and e + 64) left out", focus="gpu"),
    Mutation("index-keys-ue8m0-unrounded", "indexer", WRITE_ARCHS, ("index keys", "quantized"), INDEX_KEYS_CUH,
             "if (format != IndexScaleFormat::kPow2) return s;", "return s;", T_INDEX_KEYS,
             "index keys: scale_fmt ue8m0 keeps the raw scale instead of rounding it up to a power of two",
             focus="gpu"),
    Mutation("index-keys-scales-interleaved", "indexer", WRITE_ARCHS, ("index keys", "paged slots", "addressing"),
             INDEX_KEYS_CUH,
             "*reinterpret_cast<float*>(slot.region + int64_t(rows.rows_per_block()) * kIndexDim + slot.offset * 4) = s;",
             "*reinterpret_cast<float*>(slot.region + slot.offset * kIndexRowBytes + kIndexDim) = s;", T_INDEX_KEYS,
             "index keys: a token's scale written after its own codes (a [128 | 4] row) instead of after the page's "
             "codes", focus="gpu"),
    Mutation("index-keys-rope-style-swapped", "indexer", WRITE_ARCHS, ("index keys", "rope"), INDEX_KEYS_CUH,
             "if (style == RopeStyle::kNeox) {", "if (style != RopeStyle::kNeox) {", T_INDEX_KEYS,
             "index keys and queries: neox and interleaved rope pairs swapped", focus="gpu"),
    Mutation("index-keys-position-bound", "indexer", WRITE_ARCHS, ("index keys", "guard"), INDEX_KEYS_CUH,
             "if (pos < 0 || pos >= p.max_position) return;", "if (pos < 0 || pos > p.max_position) return;",
             T_INDEX_KEYS, "index keys: position == max_position reads the cos/sin row past the table and writes",
             focus="gpu"),
    # ------------------------------------------------------------------ merge_states
    Mutation("merge-lse-log2", "merge", ALL, ("lse",), COMMON_CUH,
             "return sum > 0.f ? m + logf(sum) : -INFINITY;",
             "return sum > 0.f ? m + log2f(sum) : -INFINITY;", T_ATTENTION + T_SWEEP,
             "merge_weights (merge_states, the narrow decode's cluster pair): lse adds log2 of the weight sum",
             focus="merge"),
    Mutation("merge-b-weight", "merge", ALL, ("split",), MERGE_CU,
             "const float vb = w.b > 0.f ? arch::to_float(b[c]) * w.b : 0.f;",
             "const float vb = w.b > 0.f ? arch::to_float(b[c]) * w.a : 0.f;", T_ATTENTION + T_SWEEP,
             "merge_states: state b weighted by a's weight", focus="merge"),
)
