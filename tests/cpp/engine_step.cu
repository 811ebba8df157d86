// mla_kv_engine_step: the MLA layers of an engine, run for one prefill with a prefix-cache hit and a
// few decode steps on a block pool laid out the way TurboMind (LMDeploy) lays one out. It uses
// mla_kv's torch-free invoke* API and nothing else, and checks every output against a CPU reference
// in double precision.
//
// What it does, for every arch tag this GPU runs, in fp16 (and in bf16 where the tag computes bf16):
//   pool     blocks of 64 tokens, each holding every layer. A layer's region starts at the sum of the
//            sizes of the earlier layers' regions. Layer 1 is an int8 layer whose region has another
//            size; mla_kv does not read int8 yet, so that layer belongs to the engine's own kernels
//            and nothing here may touch it.
//   prefix   an earlier request wrote a 128-token prompt into two blocks. The prefix cache now shares
//            those blocks with later sequences, read-only.
//   prefill  three sequences. Sequence 0 adds 37 tokens to the shared prefix. Sequence 1's whole
//            prompt was cached, so it recomputes its last token (as LMDeploy does); that token's row
//            lies in a read-only block and must not be written. Sequence 2 is a new prompt of 70
//            tokens. Per MLA layer: the fused write (RMSNorm of c_kv, RoPE of k_pe and of q's rope
//            part, the store), then causal attention over the cached and the new tokens.
//   decode   three steps of one new token per sequence: write it, then attend (q_len 1).
//
// After every step it checks:
//   - every row the step wrote, against the reference row;
//   - q's rotated rope part (its latent part must be untouched);
//   - every out and lse row of the attention;
//   - the lengths the TurboMind adapter derived;
//   - every other byte of the pool, which must be unchanged: the read-only blocks, the int8 layer,
//     the spare blocks and the rows nobody has written yet.
//
// Usage: mla_kv_engine_step [--arch sm70|sm75|sm80|sm90]   (default: every tag the device runs)
// Exit:  0 every check passed; 1 a check failed (the last line names the first failure) or the
//        --arch asked for cannot run here; 2 no CUDA device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "mla_kv/arch.h"
#include "mla_kv/attention.h"
#include "mla_kv/layout.h"
#include "mla_kv/turbomind.h"
#include "mla_kv/write.h"

namespace {

using mla_kv::Arch;
using mla_kv::DType;
using mla_kv::kLatentDim;
using mla_kv::kRopeDim;
using mla_kv::kRowDim;
using mla_kv::Status;

// ============================================================================ the model, the engine
constexpr int kBlockSeqLen = 64;   // TurboMind's cache_block_seq_len
constexpr int kHeads = 20;         // GLM-4.7-Flash's attention heads (under TP: one rank's heads)
constexpr int kSessionLen = 4096;  // the engine's session_len: bounds every kv_len and rope position
constexpr double kRopeTheta = 1e6;
constexpr float kRmsEps = 1e-6f;
constexpr float kSoftmaxScale = 0.0625f;  // 1 / sqrt(qk_nope 192 + qk_rope 64): never 1 / sqrt(576)
constexpr int kDecodeSteps = 3;

// The layers of every block, in order. A region's size depends on its layer (dtype, quantization),
// so a layer's offset in a block is the sum of the earlier regions' sizes, not layer x a constant.
enum class LayerKind { kMla, kInt8 };
constexpr int kNumLayers = 3;
constexpr LayerKind kLayers[kNumLayers] = {LayerKind::kMla, LayerKind::kInt8, LayerKind::kMla};

int64_t region_bytes(LayerKind kind, int elem_size) {
  if (kind == LayerKind::kMla) return int64_t(kBlockSeqLen) * kRowDim * elem_size;
  // TurboMind's int8 MLA layer (quant_policy 8): 64 rows of 576 int8 values, then 64 (scale, zero)
  // pairs of 2-byte floats.
  return int64_t(kBlockSeqLen) * kRowDim + int64_t(kBlockSeqLen) * 2 * 2;
}

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

struct PoolLayout {
  int64_t row_bytes;  // one MLA row: 576 values (quantized rows would add scale bytes: a stride)
  int64_t offset[kNumLayers];
  int64_t size[kNumLayers];
  int64_t block_bytes;

  explicit PoolLayout(int es) : row_bytes(int64_t(kRowDim) * es) {
    int64_t at = 0;
    for (int l = 0; l < kNumLayers; ++l) {
      offset[l] = at;  // 16-byte aligned: the kernels move rows in 16-byte vectors
      size[l] = region_bytes(kLayers[l], es);
      at += round_up(size[l], 16);
    }
    block_bytes = at;
  }
};

// Block ids, shuffled as a block manager hands them out. A sequence's list holds its blocks in
// position order; the two blocks of the cached prefix appear in both sharing sequences' lists.
// Every list already covers the sequence's final length (after the decode steps): an engine grows
// the lists between steps, but a step only needs its list to cover that step's kv_len.
const std::vector<int> kPrefixBlocks = {5, 2};  // positions 0..127 of the cached prompt
constexpr int kPrefixLen = 128;
const std::vector<int> kSpareBlocks = {6, 1, 4};  // in the pool, in no list: must stay untouched
constexpr int kNumBlocks = 9;

struct SequenceSpec {
  const char* what;
  int history;              // tokens already cached before the prefill
  int prompt_tokens;        // new tokens of the prefill
  std::vector<int> blocks;  // its block list
  int readonly_len;         // rows below this are shared prefix blocks (TurboMind: readonly_block_num x 64)
};
// Sequence 1 is LMDeploy's whole-prompt hit: all 128 tokens are cached, but the step needs one new
// token for its logits, so the last one is recomputed with history 127. Its row (position 127) is
// inside the read-only prefix and is skipped by the write; its q is still rotated and attends to
// the 128 cached rows.
const SequenceSpec kSequences[] = {
    {"follow-up turn: 128 cached tokens, 37 new", kPrefixLen, 37, {5, 2, 7}, kPrefixLen},
    {"whole prompt cached: recomputes token 127", kPrefixLen - 1, 1, {5, 2, 0}, kPrefixLen},
    {"new prompt of 70 tokens", 0, 70, {8, 3}, 0},
};
constexpr int kBatch = 3;

// ============================================================================ host helpers
struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Failure(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_status(Status s, const char* what) {
  if (s == Status::kCudaError) check_cuda(cudaGetLastError(), what);
  if (s != Status::kOk) throw Failure(std::string(what) + " returned " + mla_kv::status_string(s));
}

// A device allocation that frees itself.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes) check_cuda(cudaMalloc(&ptr_, bytes), "cudaMalloc");
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  template <class T = void>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

template <class T>
DeviceBuffer upload(const std::vector<T>& host, cudaStream_t stream) {
  DeviceBuffer d(host.size() * sizeof(T));
  if (!host.empty())
    check_cuda(cudaMemcpyAsync(d.as(), host.data(), d.bytes(), cudaMemcpyHostToDevice, stream), "upload");
  return d;
}

template <class T>
std::vector<T> download(const DeviceBuffer& d, cudaStream_t stream) {
  std::vector<T> host(d.bytes() / sizeof(T));
  check_cuda(cudaMemcpyAsync(host.data(), d.as(), d.bytes(), cudaMemcpyDeviceToHost, stream), "download");
  check_cuda(cudaStreamSynchronize(stream), "download");
  return host;
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { cudaStreamDestroy(s); }
};

// 16-bit floats as the bits the device stores. The reference always takes the value a bit pattern
// holds, so rounding the inputs costs the comparison nothing.
struct DTypeInfo {
  DType dtype;
  const char* name;
  double row_tol;  // written rows, per element: |err| <= row_tol * max(|ref|, 1/16) (2 units of rounding)
  double out_tol;  // out rows: ||err|| <= out_tol * ||ref|| (tests/gpu_checks.py's OUT_TOL)
};
const DTypeInfo kFp16{DType::kFloat16, "fp16", 0x1p-10, 3e-3};
const DTypeInfo kBf16{DType::kBFloat16, "bf16", 0x1p-7, 1e-2};
// lse: |err| <= kLseTol + kLseRelTol * |ref|; out rows judged against max(norm, floor x median norm).
constexpr double kLseTol = 1e-3, kLseRelTol = 1e-5, kRowNormFloor = 1e-2;

uint16_t to_bits(DType t, double x) {
  if (t == DType::kFloat16) return __half_raw(__float2half_rn(float(x))).x;
  return __nv_bfloat16_raw(__float2bfloat16_rn(float(x))).x;
}

double from_bits(DType t, uint16_t b) {
  if (t == DType::kFloat16) {
    __half_raw r;
    r.x = b;
    return __half2float(__half(r));
  }
  __nv_bfloat16_raw r;
  r.x = b;
  return __bfloat162float(__nv_bfloat16(r));
}

// Deterministic normal numbers (splitmix64 + Box-Muller): every arch tag sees the same data.
struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed) {}
  double uniform() {  // (0, 1)
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (double((z ^ (z >> 31)) >> 11) + 0.5) * 0x1p-53;
  }
  double normal() { return std::sqrt(-2 * std::log(uniform())) * std::cos(6.283185307179586 * uniform()); }
};

std::vector<uint16_t> random_bits(Rng& rng, DType t, size_t n, double scale, double mean = 0) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = to_bits(t, mean + scale * rng.normal());
  return v;
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

// ============================================================================ one step's batch
// A step as the engine describes it: per sequence its block list, the tokens already cached and
// the tokens it adds now.
struct Step {
  std::string name;
  std::vector<std::vector<int>> blocks;
  std::vector<int> history;
  std::vector<int> new_tokens;
  std::vector<int> readonly;  // per sequence; empty: nothing is read-only
  bool attention;             // the prefix step only writes (its attention is not what is checked here)
  bool decode;                // one token per sequence: attention's uniform form q [B, 1, H, 576]

  int batch() const { return int(history.size()); }
  // TurboMind's inputs: prefix sums of the new tokens (cu_q_len) and of the keys each sequence's
  // attention sees, history + new (cu_k_len).
  std::vector<int> cu_q_lens() const {
    std::vector<int> cu{0};
    for (int b = 0; b < batch(); ++b) cu.push_back(cu.back() + new_tokens[b]);
    return cu;
  }
  std::vector<int> cu_k_lens() const {
    std::vector<int> cu{0};
    for (int b = 0; b < batch(); ++b) cu.push_back(cu.back() + history[b] + new_tokens[b]);
    return cu;
  }
  int tokens() const { return cu_q_lens().back(); }
  int kv_len(int b) const { return history[b] + new_tokens[b]; }
  // The cache position of packed token t: history + its index in its sequence.
  std::vector<int64_t> positions() const {
    std::vector<int64_t> pos;
    for (int b = 0; b < batch(); ++b)
      for (int i = 0; i < new_tokens[b]; ++i) pos.push_back(history[b] + i);
    return pos;
  }
};

std::vector<Step> engine_steps() {
  std::vector<Step> steps;
  steps.push_back({"prefix", {kPrefixBlocks}, {0}, {kPrefixLen}, {}, false, false});
  Step prefill{"prefill", {}, {}, {}, {}, true, false};
  for (const SequenceSpec& s : kSequences) {
    prefill.blocks.push_back(s.blocks);
    prefill.history.push_back(s.history);
    prefill.new_tokens.push_back(s.prompt_tokens);
    prefill.readonly.push_back(s.readonly_len);
  }
  steps.push_back(prefill);
  for (int k = 1; k <= kDecodeSteps; ++k) {
    Step d = steps.back();
    d.name = format("decode %d", k);
    d.decode = true;
    for (int b = 0; b < d.batch(); ++b) {
      d.history[b] += d.new_tokens[b];  // everything so far is cached now
      d.new_tokens[b] = 1;
    }
    steps.push_back(d);
  }
  return steps;
}

// ============================================================================ the engine's side
// This part is what an engine writes: TurboMind's inputs on the device, one adapter launch per
// step, and per MLA layer a write and an attention call.

// A step's batch on the device.
struct DeviceStep {
  int batch = 0;
  int64_t tokens = 0;
  DeviceBuffer block_ptrs;     // void* [all lists' blocks]: block base pointers
  DeviceBuffer cu_block_nums;  // int [batch + 1]: sequence b's blocks are block_ptrs[cu[b] .. cu[b + 1])
  DeviceBuffer cu_q_lens;      // int [batch + 1]
  DeviceBuffer cu_k_lens;      // int [batch + 1]
  DeviceBuffer readonly_lens;  // int [batch], or none
  DeviceBuffer positions;      // int64 [tokens]: RoPE positions, history + i
  DeviceBuffer kv_lens;        // int [batch]: filled by invokeLengthsFromPrefixSums
  DeviceBuffer history_lens;   // int [batch]: filled by invokeLengthsFromPrefixSums
};

// This layer of the pool, as mla_kv addresses it: the same block lists for every layer, the
// layer's byte offset inside each block, rows rope first ([k_pe | c_kv]) as TurboMind stores them.
mla_kv::BlockPointerCache layer_cache(const DeviceStep& s, const PoolLayout& pool, int layer) {
  return {s.block_ptrs.as<void*>(), s.cu_block_nums.as<int>(), s.batch, kBlockSeqLen, pool.offset[layer],
          mla_kv::RowLayout::rope_first(pool.row_bytes)};
}

// The new tokens of one layer: kv_a [T, 576] = [c_kv | k_pe] (the kv_a projection's output) becomes
// rows [RoPE(k_pe) | RMSNorm(c_kv) * w] at position history + i, and q's rope part (q [T, H, 576] =
// [q_lat | q_pe]) is rotated in place, in one launch. Rows below readonly_lens are skipped; q is
// rotated for every token, skipped or not, since its attention still runs.
Status write_new_tokens(const DeviceStep& s, const mla_kv::BlockPointerCache& cache, DType dtype, const void* kv_a,
                        const void* rms_weight, const float* cos_sin, void* q, Arch arch, cudaStream_t stream) {
  const int es = mla_kv::dtype_size(dtype);
  mla_kv::WriteKvParams w{};
  w.dtype = dtype;
  w.num_tokens = s.tokens;
  w.kv_c = kv_a;
  w.kv_c_stride = kRowDim;
  w.k_pe = static_cast<const char*>(kv_a) + kLatentDim * es;
  w.k_pe_stride = kRowDim;
  w.rms_weight = rms_weight;  // non-null: the fused write
  w.rms_eps = kRmsEps;
  w.positions = s.positions.as<int64_t>();
  w.cos_sin = cos_sin;
  w.cos_sin_fp32 = true;
  w.max_position = kSessionLen;
  w.rope_style = mla_kv::RopeStyle::kInterleaved;  // GPT-J pairs, as DeepSeek / GLM / TurboMind
  w.q = q;                                         // nullptr: the prefix step has no attention
  w.q_heads = kHeads;
  w.q_head_dim = kRowDim;
  w.q_stride_token = int64_t(kHeads) * kRowDim;
  w.q_stride_head = kRowDim;
  mla_kv::BlockWriteTargets targets{s.cu_q_lens.as<int>(), s.history_lens.as<int>(), s.readonly_lens.as<int>()};
  return mla_kv::invokeWriteKvBlocks(w, cache, targets, arch, stream);
}

// Absorbed attention of one layer: out [T, H, 512] = softmax(q . row * scale) . c_kv, lse [T, H].
// Prefill passes the packed form (cu_q_lens: each sequence's new tokens, causal over its cache);
// decode the uniform form (one query per sequence). The same call serves both.
Status attend(const DeviceStep& s, const mla_kv::BlockPointerCache& cache, DType dtype, bool decode, const void* q,
              void* out, float* lse, const mla_kv::AttentionSchedule& plan, void* workspace, Arch arch,
              cudaStream_t stream) {
  mla_kv::AttentionParams a{};
  a.dtype = dtype;
  a.batch = s.batch;
  a.num_heads = kHeads;
  a.q_len = 1;                                              // decode; ignored when packed
  a.cu_q_lens = decode ? nullptr : s.cu_q_lens.as<int>();   // packed prefill
  a.total_q_tokens = s.tokens;
  a.kv_lens = s.kv_lens.as<int>();
  a.causal = true;
  a.softmax_scale = kSoftmaxScale;
  a.q = q;
  a.q_stride_b = a.q_stride_t = int64_t(kHeads) * kRowDim;  // one token per sequence in decode
  a.q_stride_h = kRowDim;
  a.out = out;
  a.out_stride_b = a.out_stride_t = int64_t(kHeads) * kLatentDim;
  a.out_stride_h = kLatentDim;
  a.lse = lse;
  a.lse_stride_b = a.lse_stride_t = kHeads;
  a.lse_stride_h = 1;
  a.num_splits = plan.num_splits;
  a.tokens_per_split = plan.tokens_per_split;
  a.workspace = workspace;
  return mla_kv::invokeAttentionBlocks(a, cache, arch, stream);
}

// The plan for a batch shape: made from sizes only, so an engine makes it (and sizes the workspace)
// at start-up or graph capture. Block pointers do not tell the library the longest sequence: the
// session length is the engine's promise that every kv_len fits the splits.
mla_kv::AttentionSchedule plan_for(const Step& step, int sm_count, Arch arch) {
  const int b = step.batch(), q_len = step.decode ? 1 : (step.tokens() + b - 1) / b;  // packed: the average
  return mla_kv::make_attention_schedule(b, q_len, kHeads, kSessionLen, sm_count, arch);
}

// ============================================================================ the reference (CPU, double)
// RoPE in GPT-J (interleaved) pairs: (x[2i], x[2i+1]) rotated by the angle of pair i at pos, with cos
// and sin taken from the same fp32 table the kernels read.
void rotate_interleaved(const double* x, int64_t pos, const std::vector<float>& cos_sin, double* y) {
  const float* cs = cos_sin.data() + pos * kRopeDim;
  for (int i = 0; i < kRopeDim / 2; ++i) {
    const double c = cs[i], s = cs[kRopeDim / 2 + i];
    y[2 * i] = x[2 * i] * c - x[2 * i + 1] * s;
    y[2 * i + 1] = x[2 * i + 1] * c + x[2 * i] * s;
  }
}

// The row the fused write stores for one token, in the cache's rope-first order:
// [RoPE(k_pe, pos) (64) | c_kv / rms(c_kv) * w (512)], from kv_a = [c_kv | k_pe].
void reference_row(const double* kv_a, const std::vector<double>& weight, int64_t pos,
                   const std::vector<float>& cos_sin, double* row) {
  double sumsq = 0;
  for (int i = 0; i < kLatentDim; ++i) sumsq += kv_a[i] * kv_a[i];
  const double inv_rms = 1 / std::sqrt(sumsq / kLatentDim + double(kRmsEps));
  for (int i = 0; i < kLatentDim; ++i) row[kRopeDim + i] = kv_a[i] * inv_rms * weight[i];
  rotate_interleaved(kv_a + kLatentDim, pos, cos_sin, row);
}

// [cos (32) | sin (32)] of position p's angles p * theta^(-2i/64), in fp32 (mla_kv.rope.cos_sin_cache).
std::vector<float> cos_sin_table() {
  std::vector<float> t(size_t(kSessionLen) * kRopeDim);
  for (int p = 0; p < kSessionLen; ++p)
    for (int i = 0; i < kRopeDim / 2; ++i) {
      const double angle = p * std::pow(kRopeTheta, -2.0 * i / kRopeDim);
      t[size_t(p) * kRopeDim + i] = float(std::cos(angle));
      t[size_t(p) * kRopeDim + kRopeDim / 2 + i] = float(std::sin(angle));
    }
  return t;
}

// Absorbed attention of query rows [T, H, 576] = [q_lat | q_pe] over each sequence's key rows
// [kv_len, 576] = [c_kv | k_pe]: query token s of sequence b (the last new_tokens[b] of its kv_len
// positions) sees positions < kv_len - new_tokens + s + 1.
struct Attention {
  std::vector<double> out;  // [T, H, 512]
  std::vector<double> lse;  // [T, H], natural log
};

Attention reference_attention(const Step& step, const std::vector<double>& q,
                              const std::vector<std::vector<double>>& keys) {
  const int T = step.tokens();
  Attention r{std::vector<double>(size_t(T) * kHeads * kLatentDim, 0.0), std::vector<double>(size_t(T) * kHeads)};
  const std::vector<int> cu_q = step.cu_q_lens();
  std::vector<double> score;
  for (int b = 0; b < step.batch(); ++b)
    for (int s = 0; s < step.new_tokens[b]; ++s) {
      const int t = cu_q[b] + s, visible = step.kv_len(b) - step.new_tokens[b] + s + 1;
      for (int h = 0; h < kHeads; ++h) {
        const double* qh = &q[(size_t(t) * kHeads + h) * kRowDim];
        score.assign(visible, 0.0);
        double m = -INFINITY;
        for (int j = 0; j < visible; ++j) {
          const double* k = &keys[b][size_t(j) * kRowDim];
          double dot = 0;
          for (int i = 0; i < kRowDim; ++i) dot += qh[i] * k[i];
          score[j] = dot * kSoftmaxScale;
          m = std::max(m, score[j]);
        }
        double sum = 0;
        double* o = &r.out[(size_t(t) * kHeads + h) * kLatentDim];
        for (int j = 0; j < visible; ++j) {
          const double p = std::exp(score[j] - m);
          sum += p;
          const double* k = &keys[b][size_t(j) * kRowDim];
          for (int i = 0; i < kLatentDim; ++i) o[i] += p * k[i];
        }
        for (int i = 0; i < kLatentDim; ++i) o[i] /= sum;
        r.lse[size_t(t) * kHeads + h] = m + std::log(sum);
      }
    }
  return r;
}

// ============================================================================ checks
// The largest error of one check, and the place of the one farthest past its tolerance.
struct Worst {
  double err = 0;     // max of error / tolerance: above 1 fails
  double shown = 0;   // max of the error itself (printed)
  std::string where;  // the place of the largest err, named by a failure
  template <class Place>
  void add(double error, double tolerance, Place&& place) {
    double normalized = error / tolerance;
    if (!std::isfinite(normalized)) normalized = error = INFINITY;  // NaN too: an unwritten value
    if (normalized > err || where.empty()) {
      err = normalized;
      where = place();
    }
    shown = std::max(shown, error);
  }
};

// The results of every step; what the program reports at its end is the first failure.
struct Report {
  std::string first_failure;
  bool step_ok = true;
  void fail(const std::string& what) {
    std::printf("  FAIL %s\n", what.c_str());
    if (first_failure.empty()) first_failure = what;
    step_ok = false;
  }
};

// The pool as the host expects it: poisoned before the run, then each row a step writes taken over
// from the device once it has been checked. Every other byte must keep its value at every step.
// MLA regions and spare blocks are poisoned with 0xFF bytes, NaN in fp16 and bf16: an attention
// that read a row nobody wrote would turn its output NaN. The int8 layer gets a byte pattern of
// its own, standing for another kernel's data.
enum : uint8_t { kPoisonMla = 0xFF, kPoisonOther = 0x5A };

std::vector<uint8_t> poisoned_pool(const PoolLayout& pool) {
  std::vector<uint8_t> image(size_t(kNumBlocks) * pool.block_bytes, kPoisonMla);
  for (int blk = 0; blk < kNumBlocks; ++blk)
    for (int l = 0; l < kNumLayers; ++l)
      if (kLayers[l] != LayerKind::kMla)
        std::memset(&image[size_t(blk) * pool.block_bytes + pool.offset[l]], kPoisonOther, pool.size[l]);
  return image;
}

std::string place_of_byte(int64_t byte, const PoolLayout& pool) {
  const int blk = int(byte / pool.block_bytes);
  const int64_t in_block = byte % pool.block_bytes;
  std::string role = "block";
  if (std::count(kPrefixBlocks.begin(), kPrefixBlocks.end(), blk)) role = "read-only prefix block";
  if (std::count(kSpareBlocks.begin(), kSpareBlocks.end(), blk)) role = "spare block";
  int l = kNumLayers - 1;
  while (pool.offset[l] > in_block) --l;
  const int64_t in_region = in_block - pool.offset[l];
  if (in_region >= pool.size[l]) return format("%s %d, alignment padding after layer %d", role.c_str(), blk, l);
  if (kLayers[l] != LayerKind::kMla)
    return format("%s %d, layer %d (the int8 layer mla_kv never touches), byte %lld", role.c_str(), blk, l,
                  (long long)in_region);
  return format("%s %d, layer %d, row %lld", role.c_str(), blk, l, (long long)(in_region / pool.row_bytes));
}

// ============================================================================ one run: a tag and a dtype
class Run {
 public:
  Run(Arch arch, const char* arch_name, const DTypeInfo& dt, int sm_count, Report& report)
      : arch(arch), arch_name(arch_name), dt(dt), sm_count(sm_count), report(report) {}

  // The whole sequence of steps on a fresh pool.
  void run() {
    // The pool: one allocation carved into blocks (TurboMind allocates its blocks in chunks too).
    expect = poisoned_pool(pool);
    d_pool = upload(expect, stream.s);
    d_cos_sin = upload(cos_sin, stream.s);
    for (int l = 0; l < kNumLayers; ++l) {  // the RMSNorm weight of each MLA layer
      std::vector<uint16_t> w;
      if (kLayers[l] == LayerKind::kMla) w = random_bits(rng, dt.dtype, kLatentDim, 0.1, 1.0);
      rms_weight.emplace_back();
      for (uint16_t x : w) rms_weight[l].push_back(from_bits(dt.dtype, x));
      d_rms_weight.push_back(upload(w, stream.s));
    }
    for (const Step& step : engine_steps()) run_step(step);
  }

 private:
  const Arch arch;
  const char* const arch_name;
  const DTypeInfo& dt;
  const int sm_count;
  Report& report;
  PoolLayout pool{mla_kv::dtype_size(dt.dtype)};
  Stream stream;
  std::vector<float> cos_sin = cos_sin_table();
  DeviceBuffer d_cos_sin;
  DeviceBuffer d_pool;
  std::vector<uint8_t> expect;                  // the pool as it must be after the current step
  std::vector<std::vector<double>> rms_weight;  // per layer (empty for the int8 layer)
  std::vector<DeviceBuffer> d_rms_weight;
  Rng rng{0x5EED};  // the same data for every tag and dtype

  void* block_ptr(int blk) const { return d_pool.as<char>() + int64_t(blk) * pool.block_bytes; }

  void run_step(const Step& step) {
    report.step_ok = true;
    const DType dtype = dt.dtype;
    const int T = step.tokens(), B = step.batch();
    const std::string what = format("%s %s %s", arch_name, dt.name, step.name.c_str());

    // ---- the engine's inputs (TurboMind's): block lists, prefix sums, read-only lengths, positions
    DeviceStep s;
    s.batch = B;
    s.tokens = T;
    std::vector<void*> ptrs;
    std::vector<int> cu_blocks{0};
    for (const auto& list : step.blocks) {
      for (int blk : list) ptrs.push_back(block_ptr(blk));
      cu_blocks.push_back(int(ptrs.size()));
    }
    s.block_ptrs = upload(ptrs, stream.s);
    s.cu_block_nums = upload(cu_blocks, stream.s);
    s.cu_q_lens = upload(step.cu_q_lens(), stream.s);
    s.cu_k_lens = upload(step.cu_k_lens(), stream.s);
    if (!step.readonly.empty()) s.readonly_lens = upload(step.readonly, stream.s);
    s.positions = upload(step.positions(), stream.s);
    s.kv_lens = DeviceBuffer(sizeof(int) * B);
    s.history_lens = DeviceBuffer(sizeof(int) * B);

    // ---- mla_kv's lengths from TurboMind's prefix sums: one launch per step, for every layer
    check_status(mla_kv::invokeLengthsFromPrefixSums(s.cu_q_lens.as<int>(), s.cu_k_lens.as<int>(), B,
                                                     s.kv_lens.as<int>(), s.history_lens.as<int>(), stream.s),
                 "invokeLengthsFromPrefixSums");

    // ---- per MLA layer: write the new tokens, then attend
    const mla_kv::AttentionSchedule plan = plan_for(step, sm_count, arch);
    std::vector<std::vector<uint16_t>> kv_a(kNumLayers), q_in(kNumLayers);
    std::vector<DeviceBuffer> d_q(kNumLayers), d_out(kNumLayers), d_lse(kNumLayers), d_kv_a(kNumLayers);
    DeviceBuffer workspace;
    for (int l = 0; l < kNumLayers; ++l) {
      if (kLayers[l] != LayerKind::kMla) continue;  // the engine's own kernels' layer
      kv_a[l] = random_bits(rng, dtype, size_t(T) * kRowDim, 1.0);
      d_kv_a[l] = upload(kv_a[l], stream.s);
      if (step.attention) {
        q_in[l] = random_bits(rng, dtype, size_t(T) * kHeads * kRowDim, 1.0);
        d_q[l] = upload(q_in[l], stream.s);
      }
      const mla_kv::BlockPointerCache cache = layer_cache(s, pool, l);
      check_status(write_new_tokens(s, cache, dtype, d_kv_a[l].as(), d_rms_weight[l].as(), d_cos_sin.as<float>(),
                                    d_q[l].as(), arch, stream.s),
                   "invokeWriteKvBlocks");
      if (!step.attention) continue;
      // Fresh NaN outputs and a NaN workspace: a row or split partial the kernel fails to write shows.
      d_out[l] = DeviceBuffer(size_t(T) * kHeads * kLatentDim * mla_kv::dtype_size(dtype));
      d_lse[l] = DeviceBuffer(size_t(T) * kHeads * sizeof(float));
      check_cuda(cudaMemsetAsync(d_out[l].as(), 0xFF, d_out[l].bytes(), stream.s), "cudaMemset");
      check_cuda(cudaMemsetAsync(d_lse[l].as(), 0xFF, d_lse[l].bytes(), stream.s), "cudaMemset");
      if (workspace.bytes() == 0)
        workspace = DeviceBuffer(mla_kv::attention_workspace_size(T, kHeads, plan.num_splits));
      if (workspace.bytes()) check_cuda(cudaMemsetAsync(workspace.as(), 0xFF, workspace.bytes(), stream.s), "cudaMemset");
      check_status(attend(s, cache, dtype, step.decode, d_q[l].as(), d_out[l].as(), d_lse[l].as<float>(), plan,
                          workspace.as(), arch, stream.s),
                   "invokeAttentionBlocks");
    }
    check_cuda(cudaStreamSynchronize(stream.s), "the step's kernels");

    // ---- checks
    std::string line = format("%-19s T=%-4d", what.c_str(), T);
    check_lengths(step, s, what);
    const std::vector<uint8_t> got = download<uint8_t>(d_pool, stream.s);
    line += check_rows(step, kv_a, got, what);
    line += check_pool(got, what);
    if (step.attention) {
      Worst q_err, out_err, lse_err;
      for (int l = 0; l < kNumLayers; ++l) {
        if (kLayers[l] != LayerKind::kMla) continue;
        const std::vector<uint16_t> q_got = download<uint16_t>(d_q[l], stream.s);
        check_q(step, l, q_in[l], q_got, q_err);
        check_attention(step, l, q_got, got, download<uint16_t>(d_out[l], stream.s),
                        download<float>(d_lse[l], stream.s), out_err, lse_err);
      }
      if (q_err.err > 1) report.fail(format("%s: q_pe %s", what.c_str(), q_err.where.c_str()));
      if (out_err.err > 1) report.fail(format("%s: out %s", what.c_str(), out_err.where.c_str()));
      if (lse_err.err > 1) report.fail(format("%s: lse %s", what.c_str(), lse_err.where.c_str()));
      line += format("  q_pe %.1e  splits %-2d out %.1e  lse %.1e", q_err.shown, plan.num_splits, out_err.shown,
                     lse_err.shown);
    }
    std::printf("%s  %s\n", line.c_str(), report.step_ok ? "ok" : "FAIL");
    std::fflush(stdout);
  }

  // The adapter's kv_lens / history_lens against the step's own lengths.
  void check_lengths(const Step& step, const DeviceStep& s, const std::string& what) {
    const std::vector<int> kv = download<int>(s.kv_lens, stream.s), hist = download<int>(s.history_lens, stream.s);
    for (int b = 0; b < step.batch(); ++b)
      if (kv[b] != step.kv_len(b) || hist[b] != step.history[b]) {
        report.fail(format("%s: invokeLengthsFromPrefixSums gave sequence %d kv_len %d, history %d; want %d, %d",
                           what.c_str(), b, kv[b], hist[b], step.kv_len(b), step.history[b]));
        return;
      }
  }

  // Every row the step writes against the reference; the rows that pass become part of `expect`.
  std::string check_rows(const Step& step, const std::vector<std::vector<uint16_t>>& kv_a,
                         const std::vector<uint8_t>& got, const std::string& what) {
    Worst worst;
    int written = 0, skipped = 0;
    const std::vector<int64_t> pos = step.positions();
    const std::vector<int> cu_q = step.cu_q_lens();
    std::vector<double> in(kRowDim), ref(kRowDim);
    for (int l = 0; l < kNumLayers; ++l) {
      if (kLayers[l] != LayerKind::kMla) continue;
      for (int b = 0; b < step.batch(); ++b)
        for (int t = cu_q[b]; t < cu_q[b + 1]; ++t) {
          if (!step.readonly.empty() && pos[t] < step.readonly[b]) {
            ++skipped;  // a shared prefix row: never written (check_pool proves it unchanged)
            continue;
          }
          const int blk = step.blocks[b][pos[t] / kBlockSeqLen];
          const size_t at = size_t(blk) * pool.block_bytes + pool.offset[l] + (pos[t] % kBlockSeqLen) * pool.row_bytes;
          for (int i = 0; i < kRowDim; ++i) in[i] = from_bits(dt.dtype, kv_a[l][size_t(t) * kRowDim + i]);
          reference_row(in.data(), rms_weight[l], pos[t], cos_sin, ref.data());
          for (int i = 0; i < kRowDim; ++i) {
            uint16_t bits;
            std::memcpy(&bits, &got[at + 2 * i], 2);
            const double g = from_bits(dt.dtype, bits);
            worst.add(std::abs(g - ref[i]) / std::max(std::abs(ref[i]), 1.0 / 16), dt.row_tol, [&] {
              return format("layer %d, sequence %d position %lld (block %d), element %d: %.6g, reference %.6g", l,
                            b, (long long)pos[t], blk, i, g, ref[i]);
            });
          }
          std::memcpy(&expect[at], &got[at], pool.row_bytes);  // judged here; check_pool judges the rest
          ++written;
        }
    }
    if (worst.err > 1) report.fail(format("%s: row %s (tolerance %.1e)", what.c_str(), worst.where.c_str(), dt.row_tol));
    std::string s = format("rows %-3d err %.1e", written, worst.shown);
    if (skipped) s += format(" (%d read-only skipped)", skipped);
    return s;
  }

  // Every byte the step must not have written: read-only blocks, the int8 layer, spare blocks, rows
  // not written yet, rows of earlier steps.
  std::string check_pool(const std::vector<uint8_t>& got, const std::string& what) {
    int64_t first = -1, differ = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != expect[i]) {
        if (first < 0) first = int64_t(i);
        ++differ;
      }
    if (first < 0) return "  pool same";
    report.fail(format("%s: %lld pool bytes changed that the step must not write, the first in %s", what.c_str(),
                       (long long)differ, place_of_byte(first, pool).c_str()));
    expect = got;  // report each stray write once
    return "  pool CHANGED";
  }

  // q after the write: its latent part untouched, its rope part rotated at the token's position.
  void check_q(const Step& step, int l, const std::vector<uint16_t>& q_in, const std::vector<uint16_t>& q_got,
               Worst& worst) {
    const std::vector<int64_t> pos = step.positions();
    double x[kRopeDim], ref[kRopeDim];
    for (int t = 0; t < step.tokens(); ++t)
      for (int h = 0; h < kHeads; ++h) {
        const size_t row = (size_t(t) * kHeads + h) * kRowDim;
        if (std::memcmp(&q_in[row], &q_got[row], kLatentDim * 2) != 0)
          worst.add(INFINITY, 1, [&] { return format("layer %d token %d head %d: q_lat changed by the write", l, t, h); });
        for (int i = 0; i < kRopeDim; ++i) x[i] = from_bits(dt.dtype, q_in[row + kLatentDim + i]);
        rotate_interleaved(x, pos[t], cos_sin, ref);
        for (int i = 0; i < kRopeDim; ++i) {
          const double g = from_bits(dt.dtype, q_got[row + kLatentDim + i]);
          worst.add(std::abs(g - ref[i]) / std::max(std::abs(ref[i]), 1.0 / 16), dt.row_tol, [&] {
            return format("layer %d token %d head %d element %d: %.6g, reference %.6g", l, t, h, i, g, ref[i]);
          });
        }
      }
  }

  // out / lse against the reference attention of the q and cache rows the device holds (both checked
  // above), so that the write's rounding does not blur the attention's: as tests/gpu_checks.py does.
  void check_attention(const Step& step, int l, const std::vector<uint16_t>& q_got, const std::vector<uint8_t>& pool_got,
                       const std::vector<uint16_t>& out, const std::vector<float>& lse, Worst& out_err, Worst& lse_err) {
    const DType t = dt.dtype;
    std::vector<double> q(q_got.size());
    for (size_t i = 0; i < q.size(); ++i) q[i] = from_bits(t, q_got[i]);
    // Each sequence's key rows in the canonical [c_kv | k_pe] order, read through its block list.
    std::vector<std::vector<double>> keys(step.batch());
    for (int b = 0; b < step.batch(); ++b) {
      keys[b].resize(size_t(step.kv_len(b)) * kRowDim);
      for (int j = 0; j < step.kv_len(b); ++j) {
        const size_t at = size_t(step.blocks[b][j / kBlockSeqLen]) * pool.block_bytes + pool.offset[l] +
                          (j % kBlockSeqLen) * pool.row_bytes;
        for (int i = 0; i < kRowDim; ++i) {
          uint16_t bits;
          std::memcpy(&bits, &pool_got[at + 2 * i], 2);
          const int c = i < kRopeDim ? kLatentDim + i : i - kRopeDim;  // stored rope first
          keys[b][size_t(j) * kRowDim + c] = from_bits(t, bits);
        }
      }
    }
    const Attention ref = reference_attention(step, q, keys);

    const int rows = step.tokens() * kHeads;
    std::vector<double> norms(rows);
    for (int r = 0; r < rows; ++r) {
      double n = 0;
      for (int i = 0; i < kLatentDim; ++i) n += ref.out[size_t(r) * kLatentDim + i] * ref.out[size_t(r) * kLatentDim + i];
      norms[r] = std::sqrt(n);
    }
    std::vector<double> sorted = norms;
    std::nth_element(sorted.begin(), sorted.begin() + rows / 2, sorted.end());
    const double floor = kRowNormFloor * sorted[rows / 2];
    // (every query here sees at least one key: no row has the reference's out 0, lse -inf)
    for (int r = 0; r < rows; ++r) {
      auto row = [&] { return format("layer %d token %d head %d", l, r / kHeads, r % kHeads); };
      double err = 0;
      for (int i = 0; i < kLatentDim; ++i) {
        const double d = from_bits(t, out[size_t(r) * kLatentDim + i]) - ref.out[size_t(r) * kLatentDim + i];
        err += d * d;
      }
      err = std::sqrt(err) / std::max(norms[r], floor);
      out_err.add(err, dt.out_tol, [&] {
        return format("%s: error %.2e > %.1e (reference norm %.3g)", row().c_str(), err, dt.out_tol, norms[r]);
      });
      const double e = std::abs(double(lse[r]) - ref.lse[r]);
      const double bound = kLseTol + kLseRelTol * std::abs(ref.lse[r]);
      lse_err.add(e, bound, [&] {
        return format("%s: %.6g, reference %.6g (tolerance %.1e)", row().c_str(), double(lse[r]), ref.lse[r], bound);
      });
    }
  }
};

struct TagInfo {
  Arch arch;
  const char* name;
};
constexpr TagInfo kTags[] = {{Arch::kSm70, "sm70"}, {Arch::kSm75, "sm75"}, {Arch::kSm80, "sm80"}, {Arch::kSm90, "sm90"}};

// The specification's own promises, checked before anything runs.
void check_sequences() {
  for (const SequenceSpec& s : kSequences) {
    const int final_len = s.history + s.prompt_tokens + kDecodeSteps;
    if (int(s.blocks.size()) * kBlockSeqLen < final_len || final_len > kSessionLen)
      throw Failure(std::string("sequence spec: blocks do not cover ") + s.what);
    if (s.readonly_len && !std::equal(kPrefixBlocks.begin(), kPrefixBlocks.end(), s.blocks.begin()))
      throw Failure(std::string("sequence spec: read-only rows without the prefix blocks: ") + s.what);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--arch" && i + 1 < argc) {
      only = argv[++i];
    } else if (a.rfind("--arch=", 0) == 0) {
      only = a.substr(7);
    } else {
      std::printf("usage: %s [--arch sm70|sm75|sm80|sm90]\n", argv[0]);
      return a == "--help" || a == "-h" ? 0 : 1;
    }
  }
  if (!only.empty() && std::none_of(std::begin(kTags), std::end(kTags), [&](const TagInfo& t) { return only == t.name; })) {
    std::printf("engine_step: FAIL: unknown --arch %s (sm70, sm75, sm80 or sm90)\n", only.c_str());
    return 1;
  }

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("engine_step: no CUDA device: nothing run\n");
    return 2;
  }
  int dev = 0, sm_count = 0;
  cudaDeviceProp prop{};
  cudaGetDevice(&dev);
  cudaGetDeviceProperties(&prop, dev);
  cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev);
  const int cc = mla_kv::device_compute_capability();

  const PoolLayout fp16_pool(2);
  std::printf("engine_step: %s (sm_%d, %d SMs), mla_kv built for %s\n", prop.name, cc, sm_count,
              mla_kv::compiled_cuda_archs());
  std::printf("pool: %d blocks of %d tokens, %lld B each (fp16): layer offsets %lld (MLA), %lld (int8, untouched), "
              "%lld (MLA); %d heads, session_len %d\n",
              kNumBlocks, kBlockSeqLen, (long long)fp16_pool.block_bytes, (long long)fp16_pool.offset[0],
              (long long)fp16_pool.offset[1], (long long)fp16_pool.offset[2], kHeads, kSessionLen);
  for (int b = 0; b < kBatch; ++b) std::printf("sequence %d: %s\n", b, kSequences[b].what);
  std::printf("tolerances: rows and q_pe |err| / max(|ref|, 1/16) <= %.1e fp16, %.1e bf16; out row ||err|| / ||ref|| "
              "<= %.0e fp16, %.0e bf16; lse |err| <= %.0e + %.0e |ref|\n",
              kFp16.row_tol, kBf16.row_tol, kFp16.out_tol, kBf16.out_tol, kLseTol, kLseRelTol);

  Report report;
  std::string ran;
  try {
    check_sequences();
    for (const TagInfo& tag : kTags) {
      if (!only.empty() && only != tag.name) continue;
      if (mla_kv::resolve_arch(tag.arch, cc) != tag.arch) {
        std::printf("%s: not run: this build (%s) has no code for it on sm_%d\n", tag.name,
                    mla_kv::compiled_cuda_archs(), cc);
        if (!only.empty()) report.fail(std::string("--arch ") + tag.name + " cannot run on this device and build");
        continue;
      }
      for (const DTypeInfo* dt : {&kFp16, &kBf16}) {
        if (dt->dtype == DType::kBFloat16 && !mla_kv::tag_has_bf16(tag.arch)) {
          std::printf("%s bf16: not run: the %s kernels compute fp16 only\n", tag.name, tag.name);
          continue;
        }
        try {
          Run{tag.arch, tag.name, *dt, sm_count, report}.run();
        } catch (const Failure& e) {
          report.fail(format("%s %s: %s", tag.name, dt->name, e.what()));
        }
        ran += format(" %s/%s", tag.name, dt->name);
      }
    }
  } catch (const Failure& e) {
    report.fail(e.what());
  }
  std::printf("ran:%s\n", ran.empty() ? " nothing" : ran.c_str());
  if (ran.empty() && report.first_failure.empty()) report.fail("no arch tag ran");
  if (!report.first_failure.empty()) {
    std::printf("engine_step: FAIL: %s\n", report.first_failure.c_str());
    return 1;
  }
  std::printf("engine_step: ok\n");
  return 0;
}
