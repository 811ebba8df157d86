// pybind11 module: converts Python ints (pointers, strides, stream) to the C++ API's structs and
// calls invoke*. No validation here (python/mla_kv/ops/ does it) and no libtorch.
#include <cstdint>
#include <stdexcept>
#include <string>

#include <pybind11/pybind11.h>

#include "mla_kv/arch.h"
#include "mla_kv/attention.h"
#include "mla_kv/expanded.h"
#include "mla_kv/gather.h"
#include "mla_kv/indexer.h"
#include "mla_kv/layout.h"
#include "mla_kv/merge.h"
#include "mla_kv/write.h"
#include "../bench/mma_throughput.h"
#include "../bench/tile_copy.h"

namespace py = pybind11;
using namespace mla_kv;

namespace {

template <class P>
P* as_ptr(uintptr_t v) { return reinterpret_cast<P*>(v); }

cudaStream_t as_stream(uintptr_t v) { return reinterpret_cast<cudaStream_t>(v); }

void check(Status s, const char* op) {
  if (s == Status::kOk) return;
  std::string msg = std::string("mla_kv.") + op + ": " + status_string(s);
  if (s == Status::kCudaError) msg += std::string(": ") + cudaGetErrorString(cudaGetLastError());
  throw std::runtime_error(msg);
}

// Pointer members are exposed to Python as integers (tensor.data_ptr()).
#define PTR_PROPERTY(Type, field)                                                  \
  def_property(#field, [](const Type& o) { return reinterpret_cast<uintptr_t>(o.field); }, \
               [](Type& o, uintptr_t v) { o.field = reinterpret_cast<decltype(o.field)>(v); })

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "mla_kv CUDA kernels (pointer-level API; use the mla_kv package)";

  py::enum_<DType>(m, "DType")
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("float32", DType::kFloat32);
  py::enum_<Arch>(m, "Arch")
      .value("auto", Arch::kAuto)
      .value("sm70", Arch::kSm70)
      .value("sm75", Arch::kSm75)
      .value("sm80", Arch::kSm80)
      .value("sm90", Arch::kSm90);
  py::class_<SmemLimits>(m, "SmemLimits")
      .def(py::init([](int per_block, int per_sm, int reserved_per_block) {
             return SmemLimits{per_block, per_sm, reserved_per_block};
           }),
           py::arg("per_block") = 0, py::arg("per_sm") = 0, py::arg("reserved_per_block") = 0)
      .def_readonly("per_block", &SmemLimits::per_block)
      .def_readonly("per_sm", &SmemLimits::per_sm)
      .def_readonly("reserved_per_block", &SmemLimits::reserved_per_block);
  m.def("device_smem_limits", &device_smem_limits);
  {
    py::list classes;
    for (const GpuClass& g : kGpuClasses) classes.append(py::make_tuple(g.name, g.tag, g.smem));
    m.attr("gpu_classes") = classes;
  }
  py::enum_<TileLoads>(m, "TileLoads")
      .value("auto", TileLoads::kAuto)
      .value("cp_async", TileLoads::kCpAsync);
  py::enum_<RopeStyle>(m, "RopeStyle")
      .value("interleaved", RopeStyle::kInterleaved)
      .value("neox", RopeStyle::kNeox);

  py::enum_<KvFormat>(m, "KvFormat")
      .value("none", KvFormat::kNone)
      .value("fp8", KvFormat::kFp8)
      .value("fp8_ds_mla", KvFormat::kFp8DsMla)
      .value("int8", KvFormat::kInt8)
      .value("int4", KvFormat::kInt4);
  py::class_<RowLayout>(m, "RowLayout")
      .def(py::init([](int latent_offset, int rope_offset, int64_t row_stride_bytes, KvFormat format, float kv_scale) {
             return RowLayout{latent_offset, rope_offset, row_stride_bytes, format, kv_scale};
           }),
           py::arg("latent_offset"), py::arg("rope_offset"), py::arg("row_stride_bytes"),
           py::arg("format") = KvFormat::kNone, py::arg("kv_scale") = 1.f);

  py::class_<PagedCache>(m, "PagedCache")
      .def(py::init([](uintptr_t base, int64_t num_blocks, int block_size, int64_t block_stride_bytes,
                       const RowLayout& row) {
             return PagedCache{as_ptr<void>(base), num_blocks, block_size, block_stride_bytes, row};
           }),
           py::arg("base"), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("block_stride_bytes"), py::arg("row"));

  py::class_<BlockPointerCache>(m, "BlockPointerCache")
      .def(py::init([](uintptr_t block_ptrs, uintptr_t cu_block_nums, int batch, int block_seq_len,
                       int64_t layer_offset_bytes, const RowLayout& row) {
             return BlockPointerCache{as_ptr<void* const>(block_ptrs), as_ptr<const int>(cu_block_nums),
                                      batch, block_seq_len, layer_offset_bytes, row};
           }),
           py::arg("block_ptrs"), py::arg("cu_block_nums"), py::arg("batch"),
           py::arg("block_seq_len"), py::arg("layer_offset_bytes"), py::arg("row"));

  py::class_<IndexCache>(m, "IndexCache")
      .def(py::init([](uintptr_t base, int64_t num_blocks, int page_size, int64_t block_stride_bytes) {
             return IndexCache{as_ptr<void>(base), num_blocks, page_size, block_stride_bytes};
           }),
           py::arg("base"), py::arg("num_blocks"), py::arg("page_size"), py::arg("block_stride_bytes"));
  py::enum_<IndexScaleFormat>(m, "IndexScaleFormat")
      .value("raw", IndexScaleFormat::kRaw)
      .value("ue8m0", IndexScaleFormat::kPow2);
  py::class_<IndexScoresParams>(m, "IndexScoresParams")
      .def(py::init([]() { return IndexScoresParams{}; }))
      .PTR_PROPERTY(IndexScoresParams, q)
      .def_readwrite("q_dtype", &IndexScoresParams::q_dtype)
      .PTR_PROPERTY(IndexScoresParams, q_scale)
      .def_readwrite("q_stride_token", &IndexScoresParams::q_stride_token)
      .def_readwrite("q_stride_head", &IndexScoresParams::q_stride_head)
      .def_readwrite("heads", &IndexScoresParams::heads)
      .PTR_PROPERTY(IndexScoresParams, weights)
      .def_readwrite("weights_stride", &IndexScoresParams::weights_stride)
      .def_readwrite("num_tokens", &IndexScoresParams::num_tokens)
      .def_readwrite("batch", &IndexScoresParams::batch)
      .def_readwrite("max_q_len", &IndexScoresParams::max_q_len)
      .PTR_PROPERTY(IndexScoresParams, cu_q_lens)
      .PTR_PROPERTY(IndexScoresParams, kv_lens)
      .PTR_PROPERTY(IndexScoresParams, block_table)
      .def_readwrite("block_table_stride", &IndexScoresParams::block_table_stride)
      .def_readwrite("max_kv_len", &IndexScoresParams::max_kv_len)
      .PTR_PROPERTY(IndexScoresParams, logits)
      .def_readwrite("logits_stride", &IndexScoresParams::logits_stride);
  m.def("index_scores", [](const IndexScoresParams& p, const IndexCache& cache, Arch arch, uintptr_t stream) {
    check(invokeIndexScores(p, cache, arch, as_stream(stream)), "index_scores");
  });

  py::class_<WriteKvParams>(m, "WriteKvParams")
      .def(py::init([]() { return WriteKvParams{}; }))
      .def_readwrite("dtype", &WriteKvParams::dtype)
      .def_readwrite("num_tokens", &WriteKvParams::num_tokens)
      .PTR_PROPERTY(WriteKvParams, kv_c)
      .def_readwrite("kv_c_stride", &WriteKvParams::kv_c_stride)
      .PTR_PROPERTY(WriteKvParams, k_pe)
      .def_readwrite("k_pe_stride", &WriteKvParams::k_pe_stride)
      .PTR_PROPERTY(WriteKvParams, rms_weight)
      .def_readwrite("rms_eps", &WriteKvParams::rms_eps)
      .PTR_PROPERTY(WriteKvParams, positions)
      .PTR_PROPERTY(WriteKvParams, cos_sin)
      .def_readwrite("cos_sin_fp32", &WriteKvParams::cos_sin_fp32)
      .def_readwrite("max_position", &WriteKvParams::max_position)
      .def_readwrite("rope_style", &WriteKvParams::rope_style)
      .PTR_PROPERTY(WriteKvParams, q)
      .def_readwrite("q_heads", &WriteKvParams::q_heads)
      .def_readwrite("q_head_dim", &WriteKvParams::q_head_dim)
      .def_readwrite("q_stride_token", &WriteKvParams::q_stride_token)
      .def_readwrite("q_stride_head", &WriteKvParams::q_stride_head);

  m.def("write_kv_paged",
        [](const WriteKvParams& p, const PagedCache& cache, uintptr_t slot_mapping, Arch arch,
           uintptr_t stream) {
          check(invokeWriteKvPaged(p, cache, as_ptr<const int64_t>(slot_mapping), arch, as_stream(stream)),
                "write_kv");
        });
  py::class_<BlockWriteTargets>(m, "BlockWriteTargets")
      .def(py::init([]() { return BlockWriteTargets{}; }))
      .PTR_PROPERTY(BlockWriteTargets, cu_q_lens)
      .PTR_PROPERTY(BlockWriteTargets, history_lens)
      .PTR_PROPERTY(BlockWriteTargets, readonly_lens)
      .def_readwrite("cp_size", &BlockWriteTargets::cp_size)
      .def_readwrite("cp_rank", &BlockWriteTargets::cp_rank);
  m.def("write_kv_blocks",
        [](const WriteKvParams& p, const BlockPointerCache& cache, const BlockWriteTargets& targets, Arch arch,
           uintptr_t stream) {
          check(invokeWriteKvBlocks(p, cache, targets, arch, as_stream(stream)), "write_kv_blocks");
        });

  py::class_<WriteIndexKeysParams>(m, "WriteIndexKeysParams")
      .def(py::init([]() { return WriteIndexKeysParams{}; }))
      .def_readwrite("dtype", &WriteIndexKeysParams::dtype)
      .def_readwrite("num_tokens", &WriteIndexKeysParams::num_tokens)
      .PTR_PROPERTY(WriteIndexKeysParams, k)
      .def_readwrite("k_stride", &WriteIndexKeysParams::k_stride)
      .PTR_PROPERTY(WriteIndexKeysParams, ln_weight)
      .PTR_PROPERTY(WriteIndexKeysParams, ln_bias)
      .def_readwrite("ln_fp32", &WriteIndexKeysParams::ln_fp32)
      .def_readwrite("ln_eps", &WriteIndexKeysParams::ln_eps)
      .PTR_PROPERTY(WriteIndexKeysParams, positions)
      .PTR_PROPERTY(WriteIndexKeysParams, cos_sin)
      .def_readwrite("cos_sin_fp32", &WriteIndexKeysParams::cos_sin_fp32)
      .def_readwrite("max_position", &WriteIndexKeysParams::max_position)
      .def_readwrite("rope_style", &WriteIndexKeysParams::rope_style)
      .def_readwrite("scale_format", &WriteIndexKeysParams::scale_format)
      .PTR_PROPERTY(WriteIndexKeysParams, q)
      .def_readwrite("q_heads", &WriteIndexKeysParams::q_heads)
      .def_readwrite("q_stride_token", &WriteIndexKeysParams::q_stride_token)
      .def_readwrite("q_stride_head", &WriteIndexKeysParams::q_stride_head);
  py::class_<IndexBlockPointerCache>(m, "IndexBlockPointerCache")
      .def(py::init([](uintptr_t block_ptrs, uintptr_t cu_block_nums, int batch, int block_seq_len,
                       int64_t layer_offset_bytes) {
             return IndexBlockPointerCache{as_ptr<void* const>(block_ptrs), as_ptr<const int>(cu_block_nums), batch,
                                           block_seq_len, layer_offset_bytes};
           }),
           py::arg("block_ptrs"), py::arg("cu_block_nums"), py::arg("batch"), py::arg("block_seq_len"),
           py::arg("layer_offset_bytes"));
  m.def("write_index_keys_paged",
        [](const WriteIndexKeysParams& p, const IndexCache& cache, uintptr_t slot_mapping, Arch arch,
           uintptr_t stream) {
          check(invokeWriteIndexKeysPaged(p, cache, as_ptr<const int64_t>(slot_mapping), arch, as_stream(stream)),
                "write_index_keys");
        });
  m.def("write_index_keys_blocks",
        [](const WriteIndexKeysParams& p, const IndexBlockPointerCache& cache, const BlockWriteTargets& targets,
           Arch arch, uintptr_t stream) {
          check(invokeWriteIndexKeysBlocks(p, cache, targets, arch, as_stream(stream)), "write_index_keys_blocks");
        });

  py::class_<AttentionPlanSizes>(m, "AttentionPlanSizes")
      .def(py::init<>())
      .def_readonly("block_m", &AttentionPlanSizes::block_m)
      .def_readonly("target_ctas", &AttentionPlanSizes::target_ctas)
      .def_readonly("max_items", &AttentionPlanSizes::max_items)
      .def_readonly("max_slots", &AttentionPlanSizes::max_slots)
      .def_readonly("max_units", &AttentionPlanSizes::max_units)
      .def_readonly("max_rows", &AttentionPlanSizes::max_rows)
      .def_readonly("plan_bytes", &AttentionPlanSizes::plan_bytes)
      .def_readonly("workspace_bytes", &AttentionPlanSizes::workspace_bytes);
  py::class_<AttentionParams>(m, "AttentionParams")
      .def(py::init([]() { return AttentionParams{}; }))
      .def_readwrite("dtype", &AttentionParams::dtype)
      .def_readwrite("batch", &AttentionParams::batch)
      .def_readwrite("num_heads", &AttentionParams::num_heads)
      .def_readwrite("q_len", &AttentionParams::q_len)
      .PTR_PROPERTY(AttentionParams, cu_q_lens)
      .def_readwrite("total_q_tokens", &AttentionParams::total_q_tokens)
      .PTR_PROPERTY(AttentionParams, kv_lens)
      .def_readwrite("causal", &AttentionParams::causal)
      .def_readwrite("softmax_scale", &AttentionParams::softmax_scale)
      .PTR_PROPERTY(AttentionParams, q)
      .def_readwrite("q_stride_b", &AttentionParams::q_stride_b)
      .def_readwrite("q_stride_t", &AttentionParams::q_stride_t)
      .def_readwrite("q_stride_h", &AttentionParams::q_stride_h)
      .PTR_PROPERTY(AttentionParams, out)
      .def_readwrite("out_stride_b", &AttentionParams::out_stride_b)
      .def_readwrite("out_stride_t", &AttentionParams::out_stride_t)
      .def_readwrite("out_stride_h", &AttentionParams::out_stride_h)
      .PTR_PROPERTY(AttentionParams, lse)
      .def_readwrite("lse_stride_b", &AttentionParams::lse_stride_b)
      .def_readwrite("lse_stride_t", &AttentionParams::lse_stride_t)
      .def_readwrite("lse_stride_h", &AttentionParams::lse_stride_h)
      .def_readwrite("num_splits", &AttentionParams::num_splits)
      .def_readwrite("tokens_per_split", &AttentionParams::tokens_per_split)
      .PTR_PROPERTY(AttentionParams, workspace)
      .def_readwrite("smem_limits", &AttentionParams::smem_limits)
      .def_readwrite("tile_loads", &AttentionParams::tile_loads)
      .PTR_PROPERTY(AttentionParams, plan)
      .def_readwrite("plan_sizes", &AttentionParams::plan_sizes);

  py::class_<AttentionTiles>(m, "AttentionTiles")
      .def_readonly("block_m", &AttentionTiles::block_m)
      .def_readonly("block_n", &AttentionTiles::block_n)
      .def_readonly("stages", &AttentionTiles::stages)
      .def_readonly("smem_bytes", &AttentionTiles::smem_bytes)
      .def_readonly("ctas_per_sm", &AttentionTiles::ctas_per_sm)
      .def_readonly("min_smem_bytes", &AttentionTiles::min_smem_bytes);
  m.def("attention_tiles", &attention_tiles);
  py::enum_<AttentionKernel>(m, "AttentionKernel")
      .value("mma_sync", AttentionKernel::kMmaSync)
      .value("wgmma", AttentionKernel::kWgmma)
      .value("wgmma_narrow", AttentionKernel::kWgmmaNarrow);
  py::enum_<TileLoadPath>(m, "TileLoadPath")
      .value("registers", TileLoadPath::kRegisters)
      .value("cp_async", TileLoadPath::kCpAsync)
      .value("tma", TileLoadPath::kTma)
      .value("bulk_copy", TileLoadPath::kBulkCopy);
  py::enum_<CombineLaunch>(m, "CombineLaunch")
      .value("none", CombineLaunch::kNone)
      .value("after", CombineLaunch::kAfter)
      .value("early", CombineLaunch::kEarly);
  py::enum_<CacheRows>(m, "CacheRows")
      .value("paged_table", CacheRows::kPagedTable)
      .value("block_pointers", CacheRows::kBlockPointers)
      .value("sparse_slots", CacheRows::kSparseSlots)
      .value("sparse_blocks", CacheRows::kSparseBlocks);
  py::class_<AttentionLaunch>(m, "AttentionLaunch")
      .def_property_readonly("status", [](const AttentionLaunch& l) { return status_string(l.status); })
      .def_property_readonly("ok", [](const AttentionLaunch& l) { return l.status == Status::kOk; })
      .def_readonly("tag", &AttentionLaunch::tag)
      .def_readonly("kernel", &AttentionLaunch::kernel)
      .def_readonly("loads", &AttentionLaunch::loads)
      .def_readonly("rows_per_cta", &AttentionLaunch::rows_per_cta)
      .def_readonly("tiles", &AttentionLaunch::tiles)
      .def_readonly("pair_merge", &AttentionLaunch::pair_merge)
      .def_readonly("combine", &AttentionLaunch::combine);
  m.def(
      "attention_launch",
      [](const AttentionParams& p, CacheRows rows, KvFormat format, const PagedCache* paged, Arch arch) {
        return attention_launch(p, rows, format, paged, arch);
      },
      py::arg("params"), py::arg("rows"), py::arg("format"), py::arg("paged").none(true), py::arg("arch"));
  py::class_<AttentionSchedule>(m, "AttentionSchedule")
      .def_readonly("num_splits", &AttentionSchedule::num_splits)
      .def_readonly("tokens_per_split", &AttentionSchedule::tokens_per_split)
      .def_readonly("tiles", &AttentionSchedule::tiles);
  m.def("make_attention_schedule", &make_attention_schedule, py::arg("batch"), py::arg("q_len"),
        py::arg("num_heads"), py::arg("max_kv_len"), py::arg("sm_count"), py::arg("arch"),
        py::arg("limits") = SmemLimits{});
  m.def("attention_workspace_size", &attention_workspace_size);
  m.def("attention_plan_sizes", &attention_plan_sizes);
  m.attr("max_plan_batch") = kMaxPlanBatch;
  m.def("attention_plan", [](const AttentionParams& p, uintptr_t stream) {
    check(invokeAttentionPlan(p, as_stream(stream)), "attention_plan");
  });
  m.def("attention_splits_valid", [](int num_splits, int tokens_per_split, int64_t max_kv_len) {
    return check_attention_splits(num_splits, tokens_per_split, max_kv_len) == Status::kOk;
  });
  m.attr("max_attention_splits") = kMaxAttentionSplits;
  m.def("attention_paged",
        [](const AttentionParams& p, const PagedCache& cache, uintptr_t block_table, int64_t block_table_stride,
           int max_blocks, Arch arch, uintptr_t stream) {
          check(invokeAttentionPaged(p, cache, as_ptr<const int>(block_table), block_table_stride, max_blocks,
                                     arch, as_stream(stream)),
                "attention");
        });
  m.def("attention_blocks", [](const AttentionParams& p, const BlockPointerCache& cache, Arch arch,
                               uintptr_t stream) {
    check(invokeAttentionBlocks(p, cache, arch, as_stream(stream)), "attention_blocks");
  });
  auto sparse_indices = [](uintptr_t indices, int64_t stride, int topk) {
    return SparseIndices{as_ptr<const int>(indices), stride, topk};
  };
  m.def("sparse_attention",
        [=](const AttentionParams& p, const PagedCache& cache, uintptr_t indices, int64_t stride, int topk, Arch arch,
            uintptr_t stream) {
          check(invokeSparseAttention(p, cache, sparse_indices(indices, stride, topk), arch, as_stream(stream)),
                "sparse_attention");
        });
  m.def("sparse_attention_blocks",
        [=](const AttentionParams& p, const BlockPointerCache& cache, uintptr_t indices, int64_t stride, int topk,
            uintptr_t cu_q_lens, Arch arch, uintptr_t stream) {
          check(invokeSparseAttentionBlocks(p, cache, sparse_indices(indices, stride, topk),
                                            as_ptr<const int>(cu_q_lens), arch, as_stream(stream)),
                "sparse_attention_blocks");
        });
  py::class_<ExpandedAttentionParams>(m, "ExpandedAttentionParams")
      .def(py::init([]() { return ExpandedAttentionParams{}; }))
      .def_readwrite("dtype", &ExpandedAttentionParams::dtype)
      .def_readwrite("batch", &ExpandedAttentionParams::batch)
      .def_readwrite("num_heads", &ExpandedAttentionParams::num_heads)
      .def_readwrite("head_dim_qk", &ExpandedAttentionParams::head_dim_qk)
      .def_readwrite("head_dim_v", &ExpandedAttentionParams::head_dim_v)
      .def_readwrite("max_q_len", &ExpandedAttentionParams::max_q_len)
      .PTR_PROPERTY(ExpandedAttentionParams, cu_q_lens)
      .PTR_PROPERTY(ExpandedAttentionParams, cu_k_lens)
      .PTR_PROPERTY(ExpandedAttentionParams, q)
      .def_readwrite("q_stride_t", &ExpandedAttentionParams::q_stride_t)
      .def_readwrite("q_stride_h", &ExpandedAttentionParams::q_stride_h)
      .PTR_PROPERTY(ExpandedAttentionParams, k)
      .def_readwrite("k_stride_t", &ExpandedAttentionParams::k_stride_t)
      .def_readwrite("k_stride_h", &ExpandedAttentionParams::k_stride_h)
      .PTR_PROPERTY(ExpandedAttentionParams, v)
      .def_readwrite("v_stride_t", &ExpandedAttentionParams::v_stride_t)
      .def_readwrite("v_stride_h", &ExpandedAttentionParams::v_stride_h)
      .PTR_PROPERTY(ExpandedAttentionParams, out)
      .def_readwrite("out_stride_t", &ExpandedAttentionParams::out_stride_t)
      .def_readwrite("out_stride_h", &ExpandedAttentionParams::out_stride_h)
      .PTR_PROPERTY(ExpandedAttentionParams, lse)
      .def_readwrite("lse_stride_t", &ExpandedAttentionParams::lse_stride_t)
      .def_readwrite("lse_stride_h", &ExpandedAttentionParams::lse_stride_h)
      .def_readwrite("softmax_scale", &ExpandedAttentionParams::softmax_scale)
      .def_readwrite("causal", &ExpandedAttentionParams::causal)
      .def_readwrite("smem_limits", &ExpandedAttentionParams::smem_limits);
  py::class_<ExpandedTiles>(m, "ExpandedTiles")
      .def_readonly("block_m", &ExpandedTiles::block_m)
      .def_readonly("block_n", &ExpandedTiles::block_n)
      .def_readonly("smem_bytes", &ExpandedTiles::smem_bytes);
  m.def("expanded_attention_supported", &expanded_attention_supported);
  m.def("expanded_attention_tiles", &expanded_attention_tiles);
  m.def("expanded_attention", [](const ExpandedAttentionParams& p, Arch arch, uintptr_t stream) {
    check(invokeExpandedAttention(p, arch, as_stream(stream)), "expanded_attention");
  });
  py::class_<MergeParams>(m, "MergeParams")
      .def(py::init([]() { return MergeParams{}; }))
      .def_readwrite("dtype", &MergeParams::dtype)
      .def_readwrite("num_rows", &MergeParams::num_rows)
      .def_readwrite("dim", &MergeParams::dim)
      .PTR_PROPERTY(MergeParams, out_a)
      .def_readwrite("out_a_stride", &MergeParams::out_a_stride)
      .PTR_PROPERTY(MergeParams, lse_a)
      .PTR_PROPERTY(MergeParams, out_b)
      .def_readwrite("out_b_stride", &MergeParams::out_b_stride)
      .PTR_PROPERTY(MergeParams, lse_b)
      .PTR_PROPERTY(MergeParams, out)
      .def_readwrite("out_stride", &MergeParams::out_stride)
      .PTR_PROPERTY(MergeParams, lse);
  m.def("merge_states", [](const MergeParams& p, uintptr_t stream) {
    check(invokeMergeStates(p, as_stream(stream)), "merge_states");
  });

  m.def("mma_throughput", [](Arch arch, DType dtype, int blocks, int iterations, uintptr_t stream) {
    const double flops = invokeMmaThroughput(arch, dtype, blocks, iterations, as_stream(stream));
    if (flops < 0) throw std::runtime_error("mla_kv.mma_throughput: unsupported arch/dtype or launch failure");
    return flops;
  });

  m.def("tile_copy_throughput", [](int method, uintptr_t src, uintptr_t table, long long block_bytes, int tile_bytes,
                                   int ctas, int tiles, int stages, int pieces, uintptr_t sink, uintptr_t stream) {
    const double bytes = invokeTileCopyThroughput(static_cast<TileCopy>(method), reinterpret_cast<const void*>(src),
                                                  reinterpret_cast<const int*>(table), block_bytes, tile_bytes, ctas,
                                                  tiles, stages, pieces, reinterpret_cast<unsigned*>(sink),
                                                  as_stream(stream));
    if (bytes < 0) throw std::runtime_error("mla_kv.tile_copy_throughput: bad arguments, no sm_90 GPU or launch failure");
    return bytes;
  });

  py::class_<GatherKvParams>(m, "GatherKvParams")
      .def(py::init([]() { return GatherKvParams{}; }))
      .def_readwrite("dtype", &GatherKvParams::dtype)
      .def_readwrite("batch", &GatherKvParams::batch)
      .PTR_PROPERTY(GatherKvParams, cu_kv_lens)
      .PTR_PROPERTY(GatherKvParams, starts)
      .PTR_PROPERTY(GatherKvParams, out)
      .def_readwrite("out_rows", &GatherKvParams::out_rows)
      .def_readwrite("out_stride", &GatherKvParams::out_stride);
  m.def("gather_kv_paged", [](const GatherKvParams& p, const PagedCache& cache, uintptr_t block_table,
                              int64_t block_table_stride, int max_blocks, Arch arch, uintptr_t stream) {
    check(invokeGatherKvPaged(p, cache, as_ptr<const int>(block_table), block_table_stride, max_blocks, arch,
                              as_stream(stream)),
          "gather_kv");
  });
  m.def("gather_kv_blocks", [](const GatherKvParams& p, const BlockPointerCache& cache, Arch arch, uintptr_t stream) {
    check(invokeGatherKvBlocks(p, cache, arch, as_stream(stream)), "gather_kv");
  });

  py::class_<IndexTopkParams>(m, "IndexTopkParams")
      .def(py::init([]() { return IndexTopkParams{}; }))
      .PTR_PROPERTY(IndexTopkParams, logits)
      .def_readwrite("logits_stride", &IndexTopkParams::logits_stride)
      .def_readwrite("num_tokens", &IndexTopkParams::num_tokens)
      .def_readwrite("batch", &IndexTopkParams::batch)
      .PTR_PROPERTY(IndexTopkParams, cu_q_lens)
      .PTR_PROPERTY(IndexTopkParams, kv_lens)
      .def_readwrite("max_kv_len", &IndexTopkParams::max_kv_len)
      .def_readwrite("k", &IndexTopkParams::k)
      .PTR_PROPERTY(IndexTopkParams, indices)
      .def_readwrite("indices_stride", &IndexTopkParams::indices_stride)
      .PTR_PROPERTY(IndexTopkParams, block_table)
      .def_readwrite("block_table_stride", &IndexTopkParams::block_table_stride)
      .def_readwrite("max_blocks", &IndexTopkParams::max_blocks)
      .def_readwrite("page_size", &IndexTopkParams::page_size);
  m.def("index_topk_workspace_size", &index_topk_workspace_size);
  m.def("index_topk", [](const IndexTopkParams& p, uintptr_t workspace, Arch arch, uintptr_t stream) {
    check(invokeIndexTopk(p, as_ptr<void>(workspace), arch, as_stream(stream)), "index_topk");
  });

  m.def("compiled_cuda_archs", &compiled_cuda_archs);
  m.def("device_compute_capability", &device_compute_capability);
  m.def("resolve_arch", &resolve_arch);
  m.def("tag_has_bf16", &tag_has_bf16);
}
