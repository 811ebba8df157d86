"""Bad input as a new user passes it (issue 14), on the CPU: each case is a TypeError/ValueError that
names the argument, raised before any work, or, where the input is valid, the same result as the
plain form (numpy and 0-d tensor scalars, layer views of a block pool, graph-padded prefill batches,
NaN rows a query cannot see).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import mla_kv
from mla_kv import ops, planner, reference, rope, weights
from mla_kv.layout import BlockPool

ROW, LAT = 576, 512
META = torch.tensor(0.0625, device="meta")  # a tensor that is not on the CPU, as a CUDA one would be


def short(value) -> str:
    """A test id: the value's repr, cut short (10 ** 400 has 401 digits)."""
    return repr(value)[:24]


# ------------------------------------------------------------------------ attention_schedule
def test_schedule_without_cuda_says_a_cuda_device_is_needed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for make in (mla_kv.attention_schedule, mla_kv.decode_workspace_size):
        with pytest.raises(RuntimeError, match="CUDA device"):
            make(1, 1, 16, 64)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(device="cpu"), ValueError, "device"),
    (dict(device="no-such-device"), ValueError, "device"),
    (dict(batch=1.5), TypeError, "batch"),
    (dict(batch=True), TypeError, "batch"),
    (dict(q_len=-1), ValueError, "q_len"),
    (dict(num_heads="16"), TypeError, "num_heads"),
    (dict(max_kv_len=None), TypeError, "max_kv_len"),
    (dict(total_q_tokens=-1), ValueError, "total_q_tokens"),
    (dict(total_q_tokens=2.0), TypeError, "total_q_tokens"),
])
def test_schedule_rejects_bad_arguments(kwargs, error, name):
    args = {**dict(batch=1, q_len=1, num_heads=16, max_kv_len=64), **kwargs}
    with pytest.raises(error, match=name):
        mla_kv.attention_schedule(**args)


# ------------------------------------------------------------------------- float arguments
def _attention_inputs(dtype=torch.float64):
    cache = torch.randn(4, 16, ROW, dtype=dtype)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    return cache, table, torch.tensor([40], dtype=torch.int32)


def _decode(op, scale):
    cache, table, lens = _attention_inputs()
    q = torch.randn(1, 2, 3, ROW, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return op(q, cache, table, lens, scale)


def _prefill(op, scale):
    cache, table, lens = _attention_inputs()
    q = torch.randn(5, 3, ROW, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return op(q, cache, table, torch.tensor([0, 5], dtype=torch.int32), lens, scale)


ATTENTION_CALLS = {
    "ops.decode": lambda s: _decode(mla_kv.decode, s), "ops.prefill": lambda s: _prefill(mla_kv.prefill, s),
    "reference.decode": lambda s: _decode(reference.decode, s),
    "reference.prefill": lambda s: _prefill(reference.prefill, s),
}


@pytest.mark.parametrize("call", ATTENTION_CALLS)
@pytest.mark.parametrize("scale", [np.float32(0.0625), np.float64(0.0625), torch.tensor(0.0625),
                                   torch.tensor(0.0625, dtype=torch.float64)], ids=short)
def test_softmax_scale_as_numpy_or_0d_cpu_tensor_equals_the_float(call, scale):
    torch.manual_seed(1)
    want = ATTENTION_CALLS[call](0.0625)
    torch.manual_seed(1)
    got = ATTENTION_CALLS[call](scale)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("call", ATTENTION_CALLS)
@pytest.mark.parametrize("scale, error", [
    (math.inf, ValueError), (-math.inf, ValueError), (math.nan, ValueError), (0.0, ValueError),
    (-0.1, ValueError), (10 ** 400, ValueError), (np.float32("inf"), ValueError), (torch.tensor(math.nan), ValueError),
    (True, TypeError), ("0.0625", TypeError), (None, TypeError), (1j, TypeError),
    (torch.tensor([0.0625]), TypeError), (META, TypeError),
], ids=short)
def test_softmax_scale_must_be_a_finite_positive_real(call, scale, error):
    with pytest.raises(error, match="softmax_scale"):
        ATTENTION_CALLS[call](scale)


def _fused_write(eps, *, blocks=False):
    """fused_write_kv of 3 tokens into a zeroed cache (or the block-pointer form) -> the cache."""
    gen = torch.Generator().manual_seed(0)
    kv_a, weight = torch.randn(3, ROW, generator=gen), torch.rand(LAT, generator=gen) + 0.5
    positions, cos_sin = torch.arange(3), rope.cos_sin_cache(64, 16, 1e4)
    if blocks:
        pool = BlockPool(2, 1, 16, torch.float32)
        cache = pool.cache(0, torch.tensor([1]), torch.tensor([0, 1]))
        mla_kv.fused_write_kv_blocks(kv_a, weight, eps, positions, cos_sin, cache,
                                     torch.tensor([0, 3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
        return None
    cache = torch.zeros(2, 16, ROW)
    mla_kv.fused_write_kv(kv_a, weight, eps, positions, cos_sin, cache, torch.arange(3))
    return cache


@pytest.mark.parametrize("eps", [np.float32(1e-6), torch.tensor(1e-6), 0], ids=short)
def test_eps_as_numpy_or_0d_tensor_equals_the_float(eps):
    assert torch.equal(_fused_write(eps), _fused_write(float(eps)))


@pytest.mark.parametrize("blocks", [False, True], ids=["paged", "blocks"])
@pytest.mark.parametrize("eps, error", [
    (math.inf, ValueError), (math.nan, ValueError), (-1e-6, ValueError), (True, TypeError),
    ("1e-6", TypeError), (None, TypeError), (META, TypeError),
], ids=short)
def test_eps_must_be_a_finite_real_at_least_0(eps, error, blocks):
    # the block-pointer form runs on CUDA only: its eps is checked before it says so
    with pytest.raises(error, match="eps"):
        _fused_write(eps, blocks=blocks)


@pytest.mark.parametrize("fused", [False, True], ids=["write", "fused"])
@pytest.mark.parametrize("targets, error, name", [
    (dict(readonly_lens=torch.zeros(1, dtype=torch.int64)), TypeError, "readonly_lens"),
    (dict(readonly_lens=torch.zeros(2, dtype=torch.int32)), ValueError, "readonly_lens"),
    (dict(readonly_lens=torch.zeros(1, 1, dtype=torch.int32)), ValueError, "readonly_lens"),
    (dict(cp_size=0), ValueError, "cp_size"), (dict(cp_size=2.0), TypeError, "cp_size"),
    (dict(cp_size=2, cp_rank=2), ValueError, "cp_rank"), (dict(cp_rank=-1), ValueError, "cp_rank"),
    (dict(cp_size=True), TypeError, "cp_size"),
], ids=short)
def test_block_write_targets_are_checked(fused, targets, error, name):
    """readonly_lens (int32 [B]) and cp_size / cp_rank are checked before anything else runs (the
    block-pointer writes then refuse CPU tensors)."""
    pool = BlockPool(2, 1, 16, torch.float32)
    cache = pool.cache(0, torch.tensor([1]), torch.tensor([0, 1]))
    cu_q, hist = torch.tensor([0, 3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    kv_a = torch.randn(3, ROW)
    with pytest.raises(error, match=name):
        if fused:
            mla_kv.fused_write_kv_blocks(kv_a, torch.ones(LAT), 1e-6, torch.arange(3), rope.cos_sin_cache(64, 16, 1e4),
                                         cache, cu_q, hist, **targets)
        else:
            mla_kv.write_kv_blocks(kv_a[:, :LAT], kv_a[:, LAT:], cache, cu_q, hist, **targets)


def test_prefill_causal_must_be_a_bool():
    cache, table, lens = _attention_inputs()
    with pytest.raises(TypeError, match="causal"):
        mla_kv.prefill(torch.randn(5, 3, ROW, dtype=torch.float64), cache, table,
                       torch.tensor([0, 5], dtype=torch.int32), lens, 0.1, causal="no")


# ------------------------------------------------------------------ strided (layer view) caches
@pytest.mark.parametrize("write", ["write_kv", "fused_write_kv", "reference.write_kv"])
def test_write_into_a_block_pool_layer_view_equals_a_contiguous_cache(write):
    pool = BlockPool(3, 3, 16, torch.float32)
    pool.storage.copy_(torch.randn(pool.storage.shape))
    before = pool.storage.clone()
    kv_a, slots = torch.randn(5, ROW), torch.tensor([17, 3, -1, 40, 0])
    rms_w, positions, cos_sin = torch.ones(LAT), torch.arange(5), rope.cos_sin_cache(64, 16, 1e4)

    def run(cache):
        if write == "fused_write_kv":
            mla_kv.fused_write_kv(kv_a, rms_w, 1e-6, positions, cos_sin, cache, slots)
        else:
            fn = mla_kv.write_kv if write == "write_kv" else reference.write_kv
            fn(kv_a[:, :LAT], kv_a[:, LAT:], cache, slots)

    expected = pool.layer_view(1).contiguous()
    run(expected)
    assert not pool.layer_view(1).is_contiguous()
    run(pool.layer_view(1))
    assert torch.equal(pool.layer_view(1), expected)
    assert not torch.equal(expected, before[:, 1]), "nothing was written"
    for other in (0, 2):
        assert torch.equal(pool.storage[:, other], before[:, other])


# ------------------------------------------------------------------------ padded prefill batch
@pytest.mark.parametrize("op, validate", [(mla_kv.prefill, False), (mla_kv.prefill, True),
                                          (reference.prefill, None)], ids=["ops", "ops-validate", "reference"])
def test_prefill_padded_batch_leaves_the_rows_past_cu_q_lens_untouched(op, validate):
    cache, table, _ = _attention_inputs()
    kv_lens = torch.tensor([40, 9], dtype=torch.int32)
    table = torch.tensor([[2, 0, 3], [1, 1, 1]], dtype=torch.int32)
    cu, pad = torch.tensor([0, 2, 5], dtype=torch.int32), 3
    q = torch.randn(5 + pad, 3, ROW, dtype=torch.float64)
    out, lse = torch.full((8, 3, LAT), 7.0, dtype=torch.float64), torch.full((8, 3), 7.0, dtype=torch.float64)
    kwargs = {} if validate is None else dict(validate=validate)
    got_out, got_lse = op(q, cache, table, cu, kv_lens, 0.1, out=out, lse=lse, **kwargs)
    want_out, want_lse = reference.prefill(q[:5], cache, table, cu, kv_lens, 0.1)
    assert got_out is out and got_lse is lse
    assert torch.equal(out[:5], want_out) and torch.equal(lse[:5], want_lse)
    assert (out[5:] == 7).all() and (lse[5:] == 7).all()


@pytest.mark.parametrize("op, kwargs", [(mla_kv.prefill, dict(validate=True)), (reference.prefill, {})],
                         ids=["ops", "reference"])
def test_prefill_cu_q_lens_past_q_is_rejected(op, kwargs):
    cache, table, lens = _attention_inputs()
    with pytest.raises(ValueError, match="cu_q_lens"):
        op(torch.randn(5, 3, ROW, dtype=torch.float64), cache, table, torch.tensor([0, 6], dtype=torch.int32),
           lens, 0.1, **kwargs)


# ------------------------------------------------------------- rows a query cannot see: NaN/Inf
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_a_nan_or_inf_row_a_query_cannot_see_leaves_it_finite(op, bad):
    """Sequence of 20 positions, queries at 17..19 (causal). Row 19 is seen only by the last query,
    rows past 20 by none; poisoning them changes nothing else and makes the last query non-finite."""
    cache = torch.randn(2, 16, ROW, dtype=torch.float64)
    table, lens = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    q = torch.randn(3, 4, ROW, dtype=torch.float64)

    def run(kv_cache):
        if op == "decode":
            out, lse = reference.decode(q[None], kv_cache, table, lens, 0.1)
            return out[0], lse[0]
        return reference.prefill(q, kv_cache, table, torch.tensor([0, 3], dtype=torch.int32), lens, 0.1)

    clean_out, clean_lse = run(cache)
    poisoned = cache.clone()
    poisoned[0, 3] = bad     # position 19 (block 0 is the table's second)
    poisoned[0, 4:] = bad    # positions 20.. : past the sequence
    out, lse = run(poisoned)
    assert torch.equal(out[:2], clean_out[:2]) and torch.equal(lse[:2], clean_lse[:2])
    assert not out[2].isfinite().all(), "the query that sees the row must see it"


def test_merge_ignores_the_out_of_a_side_that_saw_nothing():
    out_a, lse_a = torch.randn(4, 8), torch.randn(4)
    out_b, lse_b = torch.full((4, 8), math.nan), torch.full((4,), -math.inf)
    for merge in (mla_kv.merge_states, reference.merge_states):
        out, lse = merge(out_a, lse_a, out_b, lse_b)
        assert torch.equal(out, out_a) and torch.equal(lse, lse_a)


# ------------------------------------------------------------------------------------ weights
@pytest.mark.parametrize("fn, args, error, name", [
    (weights.absorb_q, (torch.ones(3, 2, 4, dtype=torch.int64), torch.randn(2, 4, 5)), TypeError, "q_nope"),
    (weights.absorb_q, (torch.randn(3, 2, 4), torch.ones(2, 4, 5, dtype=torch.int32)), TypeError, "w_uk"),
    (weights.absorb_q, ([[1.0]], torch.randn(2, 4, 5)), TypeError, "q_nope"),
    (weights.absorb_q, (None, torch.randn(2, 4, 5)), TypeError, "q_nope"),
    (weights.absorb_q, (torch.randn(3, 2, 4), None), TypeError, "w_uk"),
    (weights.absorb_q, (torch.randn(3, 2, 4), torch.randn(2, 4, 5, device="meta")), ValueError, "w_uk"),
    (weights.project_out, ([1.0], torch.randn(2, 4, 5)), TypeError, "o_lat"),
    (weights.project_out, (None, torch.randn(2, 4, 5)), TypeError, "o_lat"),
    (weights.project_out, (torch.randn(3, 2, 5), [1.0]), TypeError, "w_uv"),
    (weights.project_out, (torch.ones(3, 2, 5, dtype=torch.int64), torch.randn(2, 4, 5)), TypeError, "o_lat"),
])
def test_absorb_and_project_reject_bad_tensors(fn, args, error, name):
    with pytest.raises(error, match=name):
        fn(*args)


SPLIT = dict(num_heads=2, qk_nope_head_dim=3, v_head_dim=4, kv_lora_rank=5)


@pytest.mark.parametrize("name", SPLIT)
@pytest.mark.parametrize("value, error", [(2.0, TypeError), (-2, ValueError), (0, ValueError), (None, TypeError),
                                          (True, TypeError)], ids=short)
def test_split_kv_b_proj_rejects_bad_sizes(name, value, error):
    with pytest.raises(error, match=name):
        weights.split_kv_b_proj(torch.randn(14, 5), **dict(SPLIT, **{name: value}))


def test_split_kv_b_proj_accepts_numpy_sizes():
    w = torch.randn(14, 5)
    got = weights.split_kv_b_proj(w, *(np.int64(v) for v in SPLIT.values()))
    want = weights.split_kv_b_proj(w, **SPLIT)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("call, error, name", [
    (lambda: weights.fold_q_b_proj(torch.randn(12, 7), torch.randn(2, 4, 5), 2.0, 4, 2), TypeError, "num_heads"),
    (lambda: weights.fold_q_b_proj(torch.randn(12, 7), torch.randn(2, 4, 5), 2, 4, -2), ValueError,
     "qk_rope_head_dim"),
    (lambda: weights.dequantize_awq(torch.zeros(8, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                    torch.ones(1, 8), group_size=8.0), TypeError, "group_size"),
    (lambda: weights.dequantize_awq(torch.zeros(8, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                    torch.ones(1, 8), group_size=8, dtype=torch.int8), TypeError, "dtype"),
    (lambda: weights.load_kv_b_proj("/no/such/checkpoint", "0"), TypeError, "layer"),
    (lambda: weights.load_attention_weights("/no/such/checkpoint", -1), ValueError, "layer"),
])
def test_other_weight_helpers_reject_bad_sizes(call, error, name):
    with pytest.raises(error, match=name):
        call()


# --------------------------------------------------------------------------------------- rope
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}


def test_yarn_table_of_16_positions_is_the_start_of_a_longer_one():
    assert torch.equal(rope.cos_sin_cache(64, 16, 1e4, YARN), rope.cos_sin_cache(64, 4096, 1e4, YARN)[:16])


def test_yarn_beta_0_is_unset_as_in_hf():
    # HF reads beta_fast with `scaling.get("beta_fast") or 32`
    assert torch.equal(rope.cos_sin_cache(64, 16, 1e4, dict(YARN, beta_fast=0)),
                       rope.cos_sin_cache(64, 16, 1e4, dict(YARN, beta_fast=32)))


ZERO_MSCALE = -1 / (0.1 * math.log(40.0))  # yarn_mscale(40, it) == 0: a division by 0


@pytest.mark.parametrize("theta, scaling, error, name", [
    (1.0, YARN, ValueError, "theta"),
    (0.5, YARN, ValueError, "theta"),
    (None, dict(YARN, rope_theta=1.0), ValueError, r"scaling\['rope_theta'\]"),
    (1e4, dict(YARN, beta_fast=-1), ValueError, "beta_fast"),
    (1e4, dict(YARN, beta_slow=-1), ValueError, "beta_slow"),
    (1e4, dict(YARN, beta_fast=math.nan), ValueError, "beta_fast"),
    (1e4, dict(YARN, beta_fast="32"), TypeError, "beta_fast"),
    (1e4, dict(YARN, mscale=1.0, mscale_all_dim=ZERO_MSCALE), ValueError, "mscale_all_dim"),
    (1e4, dict(YARN, mscale=-1.0, mscale_all_dim=1.0), ValueError, "mscale"),
    (1e4, dict(YARN, factor=math.inf), ValueError, "factor"),
    (np.float64(math.nan), None, ValueError, "theta"),
])
def test_cos_sin_cache_rejects_invalid_yarn_parameters(theta, scaling, error, name):
    with pytest.raises(error, match=name):
        rope.cos_sin_cache(64, 16, theta, scaling)


def test_mla_softmax_scale_rejects_a_zero_yarn_mscale():
    with pytest.raises(ValueError, match="mscale_all_dim"):
        rope.mla_softmax_scale(128, 64, dict(YARN, mscale_all_dim=ZERO_MSCALE))


def test_rope_accepts_numpy_sizes_and_theta():
    assert torch.equal(rope.cos_sin_cache(np.int64(64), np.int32(16), np.float32(1e4)),
                       rope.cos_sin_cache(64, 16, 1e4))


# ------------------------------------------------------------------------------------ planner
MLA_CONFIG = {"model_type": "glm4_moe_lite", "num_hidden_layers": 47, "num_attention_heads": 20,
              "max_position_embeddings": 202752, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
GQA_CONFIG = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "hidden_size": 4096, "max_position_embeddings": 131072}


@pytest.mark.parametrize("config, error, name", [
    (dict(MLA_CONFIG, num_hidden_layers=0), ValueError, "num_hidden_layers"),
    (dict(MLA_CONFIG, num_attention_heads=0), ValueError, "num_attention_heads"),
    (dict(MLA_CONFIG, num_hidden_layers=-3), ValueError, "num_hidden_layers"),
    (dict(MLA_CONFIG, num_hidden_layers=2.5), TypeError, "num_hidden_layers"),
    (dict(MLA_CONFIG, num_hidden_layers="47"), TypeError, "num_hidden_layers"),
    (dict(MLA_CONFIG, num_hidden_layers=True), TypeError, "num_hidden_layers"),
    (dict(MLA_CONFIG, max_position_embeddings=0), ValueError, "max_position_embeddings"),
    (dict(MLA_CONFIG, num_nextn_predict_layers=-1), ValueError, "num_nextn_predict_layers"),
    (dict(GQA_CONFIG, num_attention_heads=0), ValueError, "num_attention_heads"),
    (dict(GQA_CONFIG, num_key_value_heads=0), ValueError, "num_key_value_heads"),
    (dict(GQA_CONFIG, head_dim=-1), ValueError, "head_dim"),
    ({"model_type": "some_vlm", "text_config": [1, 2]}, ValueError, "text_config"),
])
def test_bad_config_sizes_name_the_file_and_key(tmp_path, config, error, name):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(error, match=name) as info:
        planner.load_model(str(path))
    assert str(path) in str(info.value)


def test_non_utf8_config_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(ValueError, match="UTF-8") as info:
        planner.load_model(str(path))
    assert str(path) in str(info.value)


def test_directory_without_config_says_which_file_was_expected(tmp_path):
    with pytest.raises(ValueError, match="config.json") as info:
        planner.load_model(str(tmp_path))
    assert str(tmp_path / "config.json") in str(info.value)


@pytest.mark.parametrize("field", ["num_layers", "num_heads", "max_context", "kv_lora_rank"])
@pytest.mark.parametrize("value, error", [(0, ValueError), (-1, ValueError), (2.5, TypeError)], ids=short)
def test_models_reject_bad_sizes(field, value, error):
    sizes = {**dict(num_layers=2, num_heads=4, max_context=1024), field: value}
    with pytest.raises(error, match=field):
        planner.MlaModel("m", **sizes)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(gpu_mem_bytes=math.inf), ValueError, "gpu_mem_bytes"),
    (dict(weight_bytes=np.float64(math.inf)), ValueError, "weight_bytes"),
    (dict(reserved_bytes=None), TypeError, "reserved_bytes"),
    (dict(ratio=math.nan), ValueError, "ratio"),
    (dict(tp=np.float32(1)), TypeError, "tp"),
    (dict(cp=True), TypeError, "cp"),
    (dict(cache_dtype=["fp16"]), ValueError, "cache_dtype"),
    (dict(count_mtp_layers="no"), TypeError, "count_mtp_layers"),
    (dict(model="glm-4.7-flash"), TypeError, "model"),
])
def test_plan_rejects_bad_arguments(kwargs, error, name):
    args = {**dict(model=planner.MODELS["glm-4.7-flash"], gpu_mem_bytes=32 * 2 ** 30, weight_bytes=18.4e9), **kwargs}
    with pytest.raises(error, match=name):
        planner.plan(**args)


def test_plan_accepts_numpy_numbers():
    glm = planner.MODELS["glm-4.7-flash"]
    got = planner.plan(glm, np.int64(32 * 2 ** 30), np.float64(18.4e9), ratio=np.float64(0.8), tp=np.int64(2),
                       block_size=np.int32(64))
    assert got == planner.plan(glm, 32 * 2 ** 30, 18.4e9, ratio=0.8, tp=2, block_size=64)


def test_load_model_rejects_a_non_path():
    with pytest.raises(TypeError, match="name_or_path"):
        planner.load_model(None)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_attention_out_with_an_odd_row_stride_is_rejected_before_writing(op):
    """The kernels store out in vectors: an out whose strides are not multiples of 8 elements is
    refused (on the CPU too, so both devices accept the same calls), and left as it was."""
    cache, table, lens = _attention_inputs()
    gen = torch.Generator().manual_seed(2)
    if op == "decode":
        q, lead = torch.randn(1, 2, 3, ROW, dtype=torch.float64, generator=gen), (1, 2, 3)
        call = lambda out: mla_kv.decode(q, cache, table, lens, 0.0625, out=out)
    else:
        q, lead = torch.randn(5, 3, ROW, dtype=torch.float64, generator=gen), (5, 3)
        cu = torch.tensor([0, 5], dtype=torch.int32)
        call = lambda out: mla_kv.prefill(q, cache, table, cu, lens, 0.0625, out=out)
    storage = torch.full((*lead, 513), 7.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="out: .*multiples of 8"):
        call(storage[..., :512])
    assert (storage == 7.0).all()
