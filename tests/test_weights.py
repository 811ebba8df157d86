"""mla_kv.weights: kv_b_proj split and absorption, folding into q_b_proj / o_proj, AWQ dequantization
and safetensors loading (CPU)."""
import json
import math

import pytest
import torch

from mla_kv.reference import ROW_DIM, decode
from mla_kv.weights import (absorb_q, dequantize_awq, fold_o_proj, fold_q_b_proj, load_kv_b_proj,
                            project_out, split_kv_b_proj)

LAT, ROPE = 512, 64


def per_head_weights(heads, nope, v, dtype=torch.float64):
    """Random W_UK [H, nope, 512], W_UV [H, v, 512] and the kv_b_proj weight stacking them per head."""
    w_uk = torch.randn(heads, nope, LAT, dtype=dtype) / math.sqrt(LAT)
    w_uv = torch.randn(heads, v, LAT, dtype=dtype) / math.sqrt(LAT)
    kv_b = torch.cat([torch.cat([w_uk[h], w_uv[h]]) for h in range(heads)])
    return w_uk, w_uv, kv_b


def test_split_kv_b_proj_returns_per_head_blocks():
    w_uk, w_uv, kv_b = per_head_weights(5, 32, 48)
    got_uk, got_uv = split_kv_b_proj(kv_b, 5, 32, 48, 512)
    assert torch.equal(got_uk, w_uk) and torch.equal(got_uv, w_uv)
    with pytest.raises(ValueError, match="weight"):
        split_kv_b_proj(kv_b, 4, 32, 48, 512)
    with pytest.raises(TypeError, match="weight"):
        split_kv_b_proj(kv_b.numpy(), 5, 32, 48, 512)


def test_absorb_and_project_match_per_head_matmuls():
    w_uk, w_uv, _ = per_head_weights(3, 16, 24)
    q_nope = torch.randn(2, 7, 3, 16, dtype=torch.float64)
    o_lat = torch.randn(2, 7, 3, LAT, dtype=torch.float64)
    q_lat, out = absorb_q(q_nope, w_uk), project_out(o_lat, w_uv)
    assert q_lat.shape == (2, 7, 3, LAT) and out.shape == (2, 7, 3, 24)
    for h in range(3):
        assert torch.allclose(q_lat[..., h, :], q_nope[..., h, :] @ w_uk[h], atol=1e-13)
        assert torch.allclose(out[..., h, :], o_lat[..., h, :] @ w_uv[h].T, atol=1e-13)
    with pytest.raises(ValueError, match="q_nope"):
        absorb_q(q_nope[..., :8], w_uk)
    with pytest.raises(ValueError, match="o_lat"):
        project_out(o_lat[..., :2, :], w_uv)


def expanded_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale):
    """One query [H, nope] / [H, 64] over keys expanded per head: k = [W_UK c | k_pe], v = W_UV c."""
    heads = q_nope.shape[0]
    out = []
    for h in range(heads):
        k_nope, v = c_kv @ w_uk[h].T, c_kv @ w_uv[h].T
        scores = scale * (k_nope @ q_nope[h] + k_pe @ q_pe[h])
        out.append(torch.softmax(scores, 0) @ v)
    return torch.stack(out)


def test_absorbed_decode_equals_expanded_attention():
    heads, nope, v, n = 4, 32, 48, 37
    w_uk, w_uv, _ = per_head_weights(heads, nope, v)
    c_kv, k_pe = torch.randn(n, LAT, dtype=torch.float64), torch.randn(n, ROPE, dtype=torch.float64)
    cache = torch.cat([c_kv, k_pe], -1).view(1, n, ROW_DIM)
    q_nope = torch.randn(heads, nope, dtype=torch.float64)
    q_pe = torch.randn(heads, ROPE, dtype=torch.float64)
    q = torch.cat([absorb_q(q_nope, w_uk), q_pe], -1).view(1, 1, heads, ROW_DIM)
    o_lat, _ = decode(q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                      0.11)
    got = project_out(o_lat[0, 0], w_uv)
    want = expanded_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, 0.11)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("q_lora", [24, None])
def test_folded_projections_give_the_same_attention(q_lora):
    heads, nope, v, hidden, n = 5, 32, 48, 40, 21
    in_dim = q_lora or hidden  # without q_lora_rank the folded matrix is q_proj
    w_uk, w_uv, _ = per_head_weights(heads, nope, v)
    q_b = torch.randn(heads * (nope + ROPE), in_dim, dtype=torch.float64) / math.sqrt(in_dim)
    o_w = torch.randn(hidden, heads * v, dtype=torch.float64) / math.sqrt(heads * v)
    x = torch.randn(3, in_dim, dtype=torch.float64)  # the last 3 tokens' q_b_proj inputs

    folded_q = fold_q_b_proj(q_b, w_uk, heads, nope, ROPE)
    folded_o = fold_o_proj(o_w, w_uv)
    assert folded_q.shape == (heads * (LAT + ROPE), in_dim) and folded_o.shape == (hidden, heads * LAT)

    q_heads = (x @ q_b.T).view(3, heads, nope + ROPE)
    q_unfolded = torch.cat([absorb_q(q_heads[..., :nope], w_uk), q_heads[..., nope:]], -1)
    q_folded = (x @ folded_q.T).view(3, heads, ROW_DIM)
    assert torch.allclose(q_folded, q_unfolded, rtol=0, atol=1e-12)

    cache = torch.randn(4, 8, ROW_DIM, dtype=torch.float64)
    table = torch.randperm(4).to(torch.int32).view(1, 4)
    lens = torch.tensor([n], dtype=torch.int32)
    o_unfolded, _ = decode(q_unfolded.unsqueeze(0), cache, table, lens, 0.09)
    o_folded, _ = decode(q_folded.unsqueeze(0), cache, table, lens, 0.09)
    out_unfolded = project_out(o_unfolded[0], w_uv).flatten(-2) @ o_w.T
    out_folded = o_folded[0].flatten(-2) @ folded_o.T
    assert torch.allclose(out_folded, out_unfolded, rtol=0, atol=1e-12)


def test_folding_half_weights_rounds_once():
    heads, nope, v = 2, 16, 16
    w_uk, w_uv, _ = per_head_weights(heads, nope, v)
    q_b = torch.randn(heads * (nope + ROPE), 32, dtype=torch.float64)
    o_w = torch.randn(8, heads * v, dtype=torch.float64)
    for dtype in (torch.float16, torch.bfloat16):
        q_half, uk_half, o_half, uv_half = (t.to(dtype) for t in (q_b, w_uk, o_w, w_uv))
        want_q = fold_q_b_proj(q_half.double(), uk_half.double(), heads, nope, ROPE).to(dtype)
        want_o = fold_o_proj(o_half.double(), uv_half.double()).to(dtype)
        got_q, got_o = fold_q_b_proj(q_half, uk_half, heads, nope, ROPE), fold_o_proj(o_half, uv_half)
        assert got_q.dtype == dtype and got_o.dtype == dtype
        # float32 accumulation then one rounding: at most one step of the half type from float64's.
        for got, want in ((got_q, want_q), (got_o, want_o)):
            step = torch.finfo(dtype).eps * want.double().abs().clamp_min(1e-3)
            assert ((got.double() - want.double()).abs() <= step).all()


# ------------------------------------------------------------------------------------- AWQ
AUTOAWQ_NIBBLE_CHANNELS = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of each int32 holds this channel of 8


def pack_autoawq(values):
    """int [rows, cols] of 0..15 -> int32 [rows, cols / 8], written nibble by nibble."""
    rows, cols = values.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for group in range(cols // 8):
        for nibble, channel in enumerate(AUTOAWQ_NIBBLE_CHANNELS):
            packed[:, group] |= values[:, 8 * group + channel].long() << (4 * nibble)
    # the top nibble sets the sign bit: reinterpret the 32 bits as a signed int32
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def plain_int4_dequant(values, zeros, scales, group_size):
    """w[o, i] = (values[i, o] - zeros[i // g, o]) * scales[i // g, o], one input channel at a time."""
    in_features, out_features = values.shape
    w = torch.empty(out_features, in_features, dtype=torch.float64)
    for i in range(in_features):
        g = i // group_size
        w[:, i] = (values[i].double() - zeros[g].double()) * scales[g].double()
    return w.to(torch.float16)


@pytest.mark.parametrize("group_size", [128, 64])
def test_dequantize_awq_matches_plain_int4(group_size):
    in_features, out_features = 256, 48
    groups = in_features // group_size
    values = torch.randint(0, 16, (in_features, out_features))
    zeros = torch.randint(0, 16, (groups, out_features))
    values[0, :8] = 15  # a full top nibble: a negative packed int32
    scales = (torch.rand(groups, out_features) * 0.02 + 1e-3).to(torch.float16)
    qweight, qzeros = pack_autoawq(values), pack_autoawq(zeros)
    assert (qweight < 0).any()

    got = dequantize_awq(qweight, qzeros, scales, group_size=group_size)
    assert got.dtype == torch.float16 and got.shape == (out_features, in_features)
    assert torch.equal(got, plain_int4_dequant(values, zeros, scales, group_size))


def test_dequantize_awq_rejects_bad_input():
    qweight = torch.zeros(256, 4, dtype=torch.int32)
    qzeros = torch.zeros(2, 4, dtype=torch.int32)
    scales = torch.ones(2, 32, dtype=torch.float16)
    with pytest.raises(TypeError, match="qweight"):
        dequantize_awq(qweight.long(), qzeros, scales)
    with pytest.raises(ValueError, match="qzeros"):
        dequantize_awq(qweight, qzeros[:1], scales)
    with pytest.raises(ValueError, match="scales"):
        dequantize_awq(qweight, qzeros, scales[:, :16])
    with pytest.raises(ValueError, match="group_size"):
        dequantize_awq(qweight, qzeros, scales, group_size=100)


# ------------------------------------------------------------------------------ safetensors
def test_load_kv_b_proj_dense_file(tmp_path):
    from safetensors.torch import save_file

    _, _, kv_b = per_head_weights(4, 32, 48, dtype=torch.float32)
    other = torch.randn(8, 8)
    file = tmp_path / "model.safetensors"
    save_file({"model.layers.3.self_attn.kv_b_proj.weight": kv_b.to(torch.bfloat16),
               "model.layers.2.self_attn.kv_b_proj.weight": other}, str(file))
    got = load_kv_b_proj(file, 3)
    assert got.dtype == torch.bfloat16 and torch.equal(got, kv_b.to(torch.bfloat16))
    assert torch.equal(load_kv_b_proj(str(file), 2, dtype=torch.float64), other.double())
    with pytest.raises(ValueError, match="layer"):
        load_kv_b_proj(file, 5)
    with pytest.raises(ValueError, match="path"):
        load_kv_b_proj(tmp_path / "missing.safetensors", 3)


def test_load_kv_b_proj_awq_shards(tmp_path):
    from safetensors.torch import save_file

    in_features, out_features = 256, 4 * (32 + 48)
    values = torch.randint(0, 16, (in_features, out_features))
    zeros = torch.randint(0, 16, (2, out_features))
    scales = (torch.rand(2, out_features) * 0.02 + 1e-3).to(torch.float16)
    base = "model.layers.7.self_attn.kv_b_proj"
    shards = {
        "model-00001-of-00002.safetensors": {f"{base}.qweight": pack_autoawq(values),
                                             f"{base}.qzeros": pack_autoawq(zeros)},
        "model-00002-of-00002.safetensors": {f"{base}.scales": scales,
                                             "model.layers.7.self_attn.o_proj.weight": torch.randn(4, 4)},
    }
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
    want = plain_int4_dequant(values, zeros, scales, 128)

    # without an index every shard is scanned
    assert torch.equal(load_kv_b_proj(tmp_path, 7), want)
    weight_map = {t: name for name, tensors in shards.items() for t in tensors}
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = load_kv_b_proj(tmp_path, 7)
    assert got.dtype == torch.float16 and torch.equal(got, want)
    w_uk, w_uv = split_kv_b_proj(got, 4, 32, 48, 256)
    assert w_uk.shape == (4, 32, 256) and w_uv.shape == (4, 48, 256)
    with pytest.raises(ValueError, match="layer"):
        load_kv_b_proj(tmp_path, 6)
