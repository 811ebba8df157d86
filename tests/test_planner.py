"""mla_kv.planner against byte counts worked out by hand from the model shapes.

Expected numbers are literal arithmetic on public config values (layers, heads, 512 + 64 latent
values, 2 bytes per fp16 value), not calls into the planner. GiB = 2**30 B, GB = 10**9 B.
"""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from transformers import Glm4MoeLiteConfig

from mla_kv import layout, planner
from mla_kv.planner import GqaModel, MlaModel, load_model, plan

GIB = 2 ** 30
GLM = planner.MODELS["glm-4.7-flash"]


def test_glm_fp16_bytes_per_token():
    p = plan(GLM, 32 * GIB, 18.4e9)
    latent, expanded = p.layouts["latent"], p.layouts["expanded"]
    assert latent.bytes_per_token_per_layer == 576 * 2 == 1_152
    assert expanded.bytes_per_token_per_layer == 20 * 2 * 576 * 2 == 46_080
    assert latent.bytes_per_token == 47 * 1_152 == 54_144
    assert expanded.bytes_per_token == 47 * 46_080 == 2_165_760
    assert latent.bytes_per_block == 64 * 54_144
    assert latent.num_cached_layers == expanded.num_cached_layers == 47


@pytest.mark.parametrize("name, layers, latent_layer, expanded_layer", [
    ("deepseek-v2-lite", 27, 1_152, 16 * 2 * 1_152),
    ("deepseek-v3", 61, 1_152, 128 * 2 * 1_152),
    ("kimi-k2", 61, 1_152, 64 * 2 * 1_152),
])
def test_mla_presets_bytes_per_token(name, layers, latent_layer, expanded_layer):
    p = plan(planner.MODELS[name], 80 * GIB, 1e9)
    assert p.layouts["latent"].bytes_per_token == layers * latent_layer
    assert p.layouts["expanded"].bytes_per_token == layers * expanded_layer


def test_preset_max_contexts_match_public_configs():
    contexts = {name: m.max_context for name, m in planner.MODELS.items()}
    assert contexts["glm-4.7-flash"] == 202_752
    assert contexts["deepseek-v2-lite"] == 163_840
    assert contexts["deepseek-v3"] == 163_840
    assert contexts["kimi-k2"] == 131_072


def test_gqa_preset_for_comparison():
    p = plan(planner.MODELS["llama-3.1-8b"], 80 * GIB, 16e9)
    assert list(p.layouts) == ["kv"]
    assert p.layouts["kv"].bytes_per_token == 32 * 8 * 2 * 128 * 2 == 131_072


@pytest.mark.parametrize("dtype, size", [("fp16", 2), ("bf16", 2), ("fp32", 4)])
def test_cache_dtype_sets_element_size(dtype, size):
    p = plan(GLM, 32 * GIB, 18.4e9, cache_dtype=dtype)
    assert p.layouts["latent"].bytes_per_token_per_layer == 576 * size


def test_seed_example_v100_32g():
    """The bug report: GLM-4.7-Flash, V100-32G, 18.4 GB of weights, ratio 0.8, engine said 4,928."""
    p = plan(GLM, 32 * GIB, 18.4e9, ratio=0.8, block_size=64)
    free = 34_359_738_368 - 18_400_000_000 - 2_147_483_648      # 32 GiB - 18.4 GB - 2 GiB reserved
    assert free == 13_812_254_720
    cache = free * 4 // 5
    assert (p.free_bytes, p.cache_bytes) == (free, cache) == (13_812_254_720, 11_049_803_776)
    # expanded: 138,608,640 B per block of 64 tokens; 79 blocks = 10,950,082,560 B <= cache < 80 blocks
    expanded = p.layouts["expanded"]
    assert expanded.bytes_per_block == 138_608_640
    assert 79 * 138_608_640 <= cache < 80 * 138_608_640
    assert (expanded.num_blocks, expanded.max_tokens, expanded.session_len) == (79, 5_056, 5_056)
    assert expanded.truncated
    assert abs(expanded.max_tokens - 4_928) / 4_928 < 0.03
    # latent: 3,465,216 B per block; 3,188 blocks <= cache < 3,189 blocks
    latent = p.layouts["latent"]
    assert 3_188 * 3_465_216 <= cache < 3_189 * 3_465_216
    assert (latent.num_blocks, latent.max_tokens) == (3_188, 204_032)
    assert latent.max_tokens >= 202_752
    assert latent.session_len == 202_752 and not latent.truncated


def test_mtp_layers_counted_only_when_asked():
    assert plan(GLM, 32 * GIB, 18.4e9).layouts["latent"].bytes_per_token == 47 * 1_152
    with_mtp = plan(GLM, 32 * GIB, 18.4e9, count_mtp_layers=True).layouts["latent"]
    assert with_mtp.num_cached_layers == 48
    assert with_mtp.bytes_per_token == 48 * 1_152 == 55_296


def test_tensor_parallel_splits_heads_and_weights_not_latent():
    p = plan(GLM, 32 * GIB, 18.4e9, tp=4)
    assert p.layouts["latent"].bytes_per_token_per_layer == 1_152            # whole latent per rank
    assert p.layouts["expanded"].bytes_per_token_per_layer == 5 * 2 * 1_152  # 20 / 4 heads per rank
    assert p.weight_bytes_per_gpu == 4_600_000_000
    cache = (32 * GIB - 4_600_000_000 - 2 * GIB) * 4 // 5
    assert p.cache_bytes == cache
    assert p.layouts["latent"].num_blocks == cache // (64 * 47 * 1_152)
    assert p.layouts["expanded"].num_blocks == cache // (64 * 47 * 11_520)


def test_context_parallel_multiplies_tokens():
    one = plan(GLM, 24 * GIB, 18.4e9)
    four = plan(GLM, 24 * GIB, 18.4e9, cp=4)
    for name in ("latent", "expanded"):
        assert four.layouts[name].num_blocks == one.layouts[name].num_blocks
        assert four.layouts[name].max_tokens == 4 * one.layouts[name].max_tokens
    # 24 GiB: latent (24 GiB - 18.4 GB - 2 GiB) * 0.8 // 3,465,216 blocks of 64, times 4 ranks
    blocks = (24 * GIB - 18_400_000_000 - 2 * GIB) * 4 // 5 // 3_465_216
    assert four.layouts["latent"].max_tokens == blocks * 64 * 4
    assert one.layouts["latent"].truncated and not four.layouts["latent"].truncated
    assert four.layouts["latent"].session_len == 202_752


def test_tp_must_divide_mla_heads():
    with pytest.raises(ValueError, match="tp"):
        plan(GLM, 32 * GIB, 18.4e9, tp=3)


def test_gqa_kv_heads_replicate_past_tp():
    llama = planner.MODELS["llama-3.1-8b"]
    assert plan(llama, 80 * GIB, 16e9, tp=2).layouts["kv"].bytes_per_token_per_layer == 4 * 2 * 128 * 2
    assert plan(llama, 80 * GIB, 16e9, tp=16).layouts["kv"].bytes_per_token_per_layer == 1 * 2 * 128 * 2


def test_weights_larger_than_gpu_fit_nothing():
    p = plan(GLM, 16 * GIB, 18.4e9)
    assert p.free_bytes == 0
    for lp in p.layouts.values():
        assert lp.num_blocks == lp.max_tokens == lp.session_len == 0 and lp.truncated


def test_random_plans_satisfy_the_accounting():
    """Whole blocks that fit the cache, the cache a ratio of free memory, tokens x cp, capped context."""
    rng = random.Random(torch.initial_seed())
    mla_names = ["glm-4.7-flash", "deepseek-v2-lite", "deepseek-v3", "kimi-k2"]
    for _ in range(200):
        model = planner.MODELS[rng.choice(mla_names)]
        tp = rng.choice([d for d in (1, 2, 4, 8, 16) if model.num_heads % d == 0])
        gpu, weights = rng.uniform(8, 200) * GIB, rng.uniform(0, 400) * 1e9
        reserved, ratio = rng.uniform(0, 4) * GIB, rng.uniform(0.05, 1.0)
        block, cp = rng.choice([16, 32, 64, 128]), rng.choice([1, 2, 3, 8])
        p = plan(model, gpu, weights, ratio=ratio, reserved_bytes=reserved, block_size=block, tp=tp, cp=cp,
                 cache_dtype=rng.choice(["fp16", "bf16", "fp32"]))
        free = max(0, int(gpu) - int(weights) // tp - int(reserved))
        assert p.free_bytes == free
        assert abs(p.cache_bytes - free * ratio) <= 1
        latent, expanded = p.layouts["latent"], p.layouts["expanded"]
        assert expanded.bytes_per_token == latent.bytes_per_token * 2 * model.num_heads // tp
        for lp in (latent, expanded):
            assert lp.bytes_per_block == lp.bytes_per_token * block
            assert lp.num_blocks * lp.bytes_per_block <= p.cache_bytes < (lp.num_blocks + 1) * lp.bytes_per_block
            assert lp.max_tokens == lp.num_blocks * block * cp
            assert lp.session_len == min(lp.max_tokens, model.max_context)
            assert lp.truncated == (lp.max_tokens < model.max_context)


@pytest.mark.parametrize("kwargs, error, argument", [
    (dict(ratio=0), ValueError, "ratio"),
    (dict(ratio=1.5), ValueError, "ratio"),
    (dict(ratio="0.8"), TypeError, "ratio"),
    (dict(tp=0), ValueError, "tp"),
    (dict(cp=0), ValueError, "cp"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(block_size=2.5), TypeError, "block_size"),
    (dict(cache_dtype="fp8"), ValueError, "cache_dtype"),
    (dict(reserved_bytes=-1), ValueError, "reserved_bytes"),
    (dict(weight_bytes=-1.0), ValueError, "weight_bytes"),
    (dict(weight_bytes=float("nan")), ValueError, "weight_bytes"),
    (dict(gpu_mem_bytes=0), ValueError, "gpu_mem_bytes"),
])
def test_bad_plan_arguments_name_the_argument(kwargs, error, argument):
    args = dict(model=GLM, gpu_mem_bytes=32 * GIB, weight_bytes=18.4e9)
    args.update(kwargs)
    with pytest.raises(error, match=argument):
        plan(**args)


def test_gpu_presets():
    assert planner.gpu_mem_bytes("v100-32g") == 32 * GIB
    assert planner.gpu_mem_bytes("a100-80g") == 80 * GIB
    with pytest.raises(ValueError, match="gpu"):
        planner.gpu_mem_bytes("v100-48g")


# ---- quantized cache formats (kv_format) ------------------------------------------------------

# Bytes of one token of one layer, from the byte layout of each format (fp16 compute dtype):
FORMAT_BYTES = {
    None: 576 * 2,                      # 512 + 64 fp16 values
    "fp8": 576,                         # 576 e4m3 values; the dequant scale is per tensor, not per token
    "fp8_ds_mla": 512 + 4 * 4 + 64 * 2,  # 512 e4m3, 4 fp32 tile scales, 64 bf16 k_pe
    "int8": 576 + 2 * 2,                # 576 one-byte codes + fp16 (scale, zero) in the block's trailer
    "int4": 576 // 2 + 2 * 2,           # 288 B of nibbles + the same trailer
}
SEED_CACHE = (34_359_738_368 - 18_400_000_000 - 2_147_483_648) * 4 // 5   # 11,049,803,776 B


def test_format_bytes_are_the_numbers_of_the_issue():
    assert FORMAT_BYTES == {None: 1_152, "fp8": 576, "fp8_ds_mla": 656, "int8": 580, "int4": 292}
    assert set(FORMAT_BYTES) == set(layout.KV_FORMATS)


@pytest.mark.parametrize("kv_format", list(FORMAT_BYTES), ids=str)
def test_kv_format_latent_bytes_blocks_and_tokens(kv_format):
    """The seed example (GLM-4.7-Flash, V100-32G, 18.4 GB, ratio 0.8) in every format."""
    per_layer = FORMAT_BYTES[kv_format]
    p = plan(GLM, 32 * GIB, 18.4e9, kv_format=kv_format)
    assert p.kv_format == kv_format and p.cache_bytes == SEED_CACHE
    latent = p.layouts["latent"]
    assert latent.bytes_per_token_per_layer == per_layer
    assert latent.bytes_per_token == 47 * per_layer
    assert latent.bytes_per_block == 64 * 47 * per_layer
    blocks = SEED_CACHE // (64 * 47 * per_layer)
    assert blocks * 64 * 47 * per_layer <= SEED_CACHE < (blocks + 1) * 64 * 47 * per_layer
    assert (latent.num_blocks, latent.max_tokens) == (blocks, blocks * 64)
    assert latent.session_len == 202_752 and not latent.truncated
    # the expanded per-head layout has no quantized form: planned for the unquantized cache alone
    assert list(p.layouts) == (["latent", "expanded"] if kv_format is None else ["latent"])


def test_kv_format_seed_example_blocks():
    blocks = {f: plan(GLM, 32 * GIB, 18.4e9, kv_format=f).layouts["latent"].num_blocks for f in FORMAT_BYTES}
    assert blocks == {None: 3_188, "fp8": 6_377, "fp8_ds_mla": 5_599, "int8": 6_333, "int4": 12_580}


@pytest.mark.parametrize("cache_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("kv_format", ["fp8", "fp8_ds_mla", "int8", "int4"])
def test_kv_format_bytes_come_from_the_layout(kv_format, cache_dtype):
    dtype = planner.CACHE_DTYPES[cache_dtype]
    latent = plan(GLM, 32 * GIB, 18.4e9, kv_format=kv_format, cache_dtype=cache_dtype,
                  block_size=32).layouts["latent"]
    assert latent.bytes_per_token_per_layer == layout.bytes_per_token(kv_format, dtype) == FORMAT_BYTES[kv_format]
    assert latent.bytes_per_block == 47 * layout.block_bytes(kv_format, 32, dtype) == 47 * 32 * FORMAT_BYTES[kv_format]


def test_planner_follows_the_layouts_row_bytes(monkeypatch):
    """One source for the numbers: a changed row in mla_kv.layout changes the plan."""
    monkeypatch.setitem(layout._ROW_BYTES, "int8", 600)
    latent = plan(GLM, 32 * GIB, 18.4e9, kv_format="int8").layouts["latent"]
    assert latent.bytes_per_token_per_layer == 600 + 4
    assert latent.bytes_per_block == 64 * 47 * 604


def test_kv_format_max_tokens_scale_with_the_bytes():
    """A cache that holds many blocks: tokens go as 1 / bytes per token (whole blocks aside)."""
    tokens = {f: plan(GLM, 141 * GIB, 18.4e9, block_size=16, kv_format=f).layouts["latent"].max_tokens
              for f in FORMAT_BYTES}
    for f, per_layer in FORMAT_BYTES.items():
        ratio = tokens[f] / tokens[None]
        assert abs(ratio - 1_152 / per_layer) < 1e-3 * 1_152 / per_layer, (f, ratio)
    assert tokens["int4"] > tokens["fp8"] > tokens["int8"] > tokens["fp8_ds_mla"] > tokens[None]


def test_kv_format_lifts_the_truncation():
    # 24 GiB: 4,179,722,649 B of cache; 16-bit latent 77,184 tokens (truncated), int4 304,512
    cache = (24 * GIB - 18_400_000_000 - 2 * GIB) * 4 // 5
    fp16 = plan(GLM, 24 * GIB, 18.4e9).layouts["latent"]
    int4 = plan(GLM, 24 * GIB, 18.4e9, kv_format="int4").layouts["latent"]
    assert fp16.max_tokens == cache // (64 * 47 * 1_152) * 64 and fp16.truncated
    assert int4.max_tokens == cache // (64 * 47 * 292) * 64 >= 202_752
    assert int4.session_len == 202_752 and not int4.truncated


def test_kv_format_with_tp_cp_and_mtp():
    p = plan(GLM, 32 * GIB, 18.4e9, kv_format="int4", tp=4, cp=2, count_mtp_layers=True)
    latent = p.layouts["latent"]
    assert latent.bytes_per_token_per_layer == 292       # every rank keeps the whole latent row
    assert latent.bytes_per_token == 48 * 292
    cache = (32 * GIB - 4_600_000_000 - 2 * GIB) * 4 // 5
    assert latent.max_tokens == cache // (64 * 48 * 292) * 64 * 2
    with pytest.raises(ValueError, match="tp"):
        plan(GLM, 32 * GIB, 18.4e9, kv_format="int8", tp=3)


def test_kv_format_none_is_todays_plan():
    default = plan(GLM, 32 * GIB, 18.4e9)
    assert plan(GLM, 32 * GIB, 18.4e9, kv_format=None) == default and default.kv_format is None
    assert "kv_format" not in default.to_dict()                   # the JSON of before kv_format
    assert plan(GLM, 32 * GIB, 18.4e9, kv_format="fp8").to_dict()["kv_format"] == "fp8"
    assert planner.format_plan(default, "v100-32g") == """\
model        glm-4.7-flash: MLA, 47 cached layers, 20 heads, max context 202,752
GPU          32.00 GiB (v100-32g), tp 1, cp 1
memory/GPU   weights 18.40 GB, reserved 2.00 GiB, free 12.86 GiB, cache 0.8 x free = 10.29 GiB
cache        fp16, block size 64

layout    B/token/layer    B/token      B/block  blocks  max tokens  session_len
latent            1,152     54,144    3,465,216   3,188     204,032  202,752
expanded         46,080  2,165,760  138,608,640      79       5,056  5,056 (truncated)

the latent layout stores 40x fewer bytes per token than the expanded per-head layout"""


def test_format_plan_of_a_quantized_format():
    text = planner.format_plan(plan(GLM, 32 * GIB, 18.4e9, kv_format="int8"), "v100-32g")
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()}
    assert rows["latent"][1:7] == ["580", "27,260", "1,744,640", "6,333", "405,312", "202,752"]
    assert "expanded" not in rows                                 # no row of the expanded layout
    assert "cache        int8, per-token scale and zero in fp16, block size 64" in text.splitlines()
    assert text.splitlines()[-1].startswith("the expanded per-head layout has no int8 form")


def test_plan_kv_formats_and_their_table():
    plans = planner.plan_kv_formats(GLM, 32 * GIB, 18.4e9)
    assert [p.kv_format for p in plans] == [None, "fp8", "fp8_ds_mla", "int8", "int4"]
    text = planner.format_kv_formats(plans, "v100-32g")
    table = text.split("\n\n")[1].splitlines()
    assert table[0].split()[0] == "format" and len(table) == 1 + 5
    for line, f in zip(table[1:], FORMAT_BYTES):
        cells = line.split()
        per_layer = FORMAT_BYTES[f]
        blocks = SEED_CACHE // (64 * 47 * per_layer)
        assert cells[0] == (f or "fp16")
        assert cells[1:7] == [f"{n:,}" for n in (per_layer, 47 * per_layer, 64 * 47 * per_layer, blocks,
                                                 blocks * 64, 202_752)]
    with pytest.raises(TypeError, match="kv_format"):
        planner.plan_kv_formats(GLM, 32 * GIB, 18.4e9, kv_format="int8")


@pytest.mark.parametrize("kwargs, argument", [
    (dict(kv_format="fp16"), "kv_format"),
    (dict(kv_format="INT8"), "kv_format"),
    (dict(kv_format=8), "kv_format"),
    (dict(kv_format="int8", cache_dtype="fp32"), "cache_dtype"),
    (dict(kv_format="int4", cache_dtype="fp32"), "cache_dtype"),
    (dict(kv_format="fp8", model=planner.MODELS["llama-3.1-8b"]), "kv_format"),
    (dict(kv_format="int4", model=MlaModel("small", num_layers=2, num_heads=4, max_context=4096, kv_lora_rank=32,
                                             qk_rope_head_dim=16)), "kv_format"),
])
def test_bad_kv_format_names_the_argument(kwargs, argument):
    args = dict(model=GLM, gpu_mem_bytes=32 * GIB, weight_bytes=18.4e9)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"^{argument}: "):
        plan(**args)


# ---- HF config.json loading --------------------------------------------------------------------

GLM_CONFIG = {  # the fields of zai-org/GLM-4.7-Flash's config.json that the planner reads, and a few others
    "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "hidden_size": 2048,
    "num_hidden_layers": 47, "num_attention_heads": 20, "num_key_value_heads": 20, "kv_lora_rank": 512,
    "q_lora_rank": 768, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "max_position_embeddings": 202752, "num_nextn_predict_layers": 1,
}


def _write(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_load_mla_config_file_and_directory(tmp_path):
    path = _write(tmp_path, GLM_CONFIG)
    for source in (str(path), str(tmp_path)):
        model = load_model(source)
        assert isinstance(model, MlaModel)
        assert (model.num_layers, model.num_heads, model.max_context, model.num_mtp_layers) == (47, 20, 202_752, 1)
        p = plan(model, 32 * GIB, 18.4e9)
        assert (p.layouts["latent"].max_tokens, p.layouts["expanded"].max_tokens) == (204_032, 5_056)


def test_load_config_written_by_transformers(tmp_path):
    path = tmp_path / "config.json"
    Glm4MoeLiteConfig(num_hidden_layers=5, num_attention_heads=8, max_position_embeddings=4096).to_json_file(path)
    model = load_model(str(path))
    assert isinstance(model, MlaModel)
    assert (model.num_layers, model.num_heads, model.max_context) == (5, 8, 4096)
    assert plan(model, 8 * GIB, 1e9).layouts["expanded"].bytes_per_token_per_layer == 8 * 2 * 576 * 2


def test_load_small_mla_rows_from_config(tmp_path):
    config = dict(GLM_CONFIG, model_type="deepseek_v3", kv_lora_rank=32, qk_rope_head_dim=16, num_hidden_layers=2)
    model = load_model(str(_write(tmp_path, config)))
    assert plan(model, 8 * GIB, 1e9).layouts["latent"].bytes_per_token == 2 * (32 + 16) * 2


def test_load_gqa_config(tmp_path):
    config = {"model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "hidden_size": 8192, "max_position_embeddings": 131072}
    model = load_model(str(_write(tmp_path, config)))
    assert isinstance(model, GqaModel)
    assert model.head_dim == 8192 // 64 == 128
    assert plan(model, 80 * GIB, 1e9).layouts["kv"].bytes_per_token == 80 * 8 * 2 * 128 * 2
    text = {"model_type": "some_vlm", "text_config": dict(config, head_dim=96)}
    assert load_model(str(_write(tmp_path, text, "vlm.json"))).head_dim == 96


@pytest.mark.parametrize("content, message", [
    ({"model_type": "mamba", "num_hidden_layers": 4}, "mamba"),
    ({k: v for k, v in GLM_CONFIG.items() if k != "kv_lora_rank"}, "kv_lora_rank"),
    ("{not json", "JSON"),
    ([1, 2], "object"),
])
def test_bad_configs_raise_value_error(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load_model(str(path))


def test_unknown_model_names_the_presets(tmp_path):
    with pytest.raises(ValueError, match="glm-4.7-flash"):
        load_model("glm-6")
    with pytest.raises(ValueError, match="no such file"):
        load_model(str(tmp_path / "missing" / "config.json"))


# ---- DeepSeek Sparse Attention: the index cache -------------------------------------------------

@pytest.mark.parametrize("name, layers, indexed, index_heads", [
    ("deepseek-v3.2", 61, 61, 64), ("glm-5", 78, 78, 32), ("glm-5.1", 78, 78, 32), ("glm-5.2", 78, 21, 32),
])
def test_dsa_presets_count_the_index_cache(name, layers, indexed, index_heads):
    model = planner.MODELS[name]
    assert (model.index_n_heads, model.index_head_dim, model.index_topk) == (index_heads, 128, 2048)
    p = plan(model, 141 * GIB, 700e9, tp=8, block_size=64)
    for lp in p.layouts.values():
        assert lp.index_bytes_per_token == indexed * (128 + 4)     # 128 e4m3 codes + a float32 scale
        assert lp.bytes_per_token == layers * lp.bytes_per_token_per_layer + indexed * 132
        assert lp.bytes_per_block == 64 * lp.bytes_per_token
        assert lp.num_blocks == p.cache_bytes // lp.bytes_per_block
    assert p.layouts["latent"].bytes_per_token_per_layer == 1_152
    # the index cache is in every format's plan, and the same there
    for q in planner.plan_kv_formats(model, 141 * GIB, 700e9, tp=8):
        assert q.layouts["latent"].index_bytes_per_token == indexed * 132
    with_mtp = plan(model, 141 * GIB, 700e9, tp=8, count_mtp_layers=True).layouts["latent"]
    assert with_mtp.index_bytes_per_token == (indexed + 1) * 132


def test_glm_5_2_shared_layers_read_the_previous_indexed_layers_top_k():
    model = planner.MODELS["glm-5.2"]
    assert model.index_layers == (0, 1, 2) + tuple(range(6, 75, 4)) and len(model.index_layers) == 21
    sources = planner.index_source_layers(model)
    assert sources[:12] == [0, 1, 2, 2, 2, 2, 6, 6, 6, 6, 10, 10]
    assert sources[74:] == [74, 74, 74, 74] and len(sources) == 78
    assert planner.index_source_layers(planner.MODELS["glm-5"]) == list(range(78))
    assert planner.index_source_layers(GLM) == [None] * 47                  # no DSA


def test_dsa_json_and_dense_json():
    dsa = plan(planner.MODELS["glm-5.2"], 141 * GIB, 700e9, tp=8).to_dict()
    assert dsa["latent"]["index_bytes_per_token"] == 21 * 132 and len(dsa["model"]["index_layers"]) == 21
    dense = plan(GLM, 32 * GIB, 18.4e9).to_dict()                  # the JSON of before DSA
    assert "index_bytes_per_token" not in dense["latent"] and "index_layers" not in dense["model"]


@pytest.mark.parametrize("extra, indexed", [
    ({}, tuple(range(8))),
    ({"indexer_types": ["full", "shared", "full"] + ["shared"] * 5}, (0, 2)),
    ({"index_topk_pattern": "FFSSFSSS"}, (0, 1, 4)),
    ({"index_topk_freq": 4, "index_skip_topk_offset": 3}, (0, 1, 2, 6)),   # GLM-5.2's schedule
])
def test_load_dsa_configs(tmp_path, extra, indexed):
    config = dict(GLM_CONFIG, model_type="glm_moe_dsa", num_hidden_layers=8, index_n_heads=32, index_head_dim=128,
                  index_topk=2048, **extra)
    model = load_model(str(_write(tmp_path, config)))
    assert model.index_layers == indexed and model.index_n_heads == 32
    assert plan(model, 80 * GIB, 1e9).layouts["latent"].index_bytes_per_token == len(indexed) * 132


def test_load_dsa_configs_written_by_transformers(tmp_path):
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    DeepseekV32Config(num_hidden_layers=3).to_json_file(tmp_path / "v32.json")
    model = load_model(str(tmp_path / "v32.json"))
    assert (model.index_n_heads, model.index_topk, model.index_layers) == (64, 2048, (0, 1, 2))
    GlmMoeDsaConfig(num_hidden_layers=10, index_topk_freq=4, index_skip_topk_offset=3).to_json_file(tmp_path / "g.json")
    assert load_model(str(tmp_path / "g.json")).index_layers == (0, 1, 2, 6)


@pytest.mark.parametrize("extra, message", [
    ({"indexer_types": ["shared"] + ["full"] * 7}, "layer 0"),
    ({"indexer_types": ["full"] * 3}, "indexer_types"),
    ({"index_n_heads": None}, "index_n_heads"),
])
def test_bad_dsa_configs(tmp_path, extra, message):
    config = dict(GLM_CONFIG, model_type="glm_moe_dsa", num_hidden_layers=8, index_n_heads=32, index_head_dim=128,
                  index_topk=2048)
    config.update(extra)
    with pytest.raises(ValueError, match=message):
        load_model(str(_write(tmp_path, config)))


# ---- DeepSeek-V4: window rings, compressed entries, index keys, compressor states ------------------------------
V4_FLASH = planner.MODELS["deepseek-v4-flash"]
V4_PRO = planner.MODELS["deepseek-v4-pro"]


def test_v4_presets_layer_types():
    assert (V4_FLASH.num_layers, V4_FLASH.num_heads, V4_FLASH.index_topk) == (43, 64, 512)
    assert [V4_FLASH.count(t) for t in ("window", "csa", "hca")] == [2, 21, 20]
    assert (V4_PRO.num_layers, V4_PRO.num_heads, V4_PRO.index_topk) == (61, 128, 1024)
    assert [V4_PRO.count(t) for t in ("window", "csa", "hca")] == [0, 30, 31]
    for m in (V4_FLASH, V4_PRO):
        assert (m.window, m.csa_ratio, m.hca_ratio, m.index_n_heads, m.index_head_dim) == (128, 4, 128, 64, 128)
    assert planner.index_source_layers(V4_FLASH)[:4] == [None, None, 2, None]


@pytest.mark.parametrize("kv_format, cache_dtype, page", [
    (None, "bf16", 64 * 1_024), (None, "fp16", 64 * 1_024),
    ("v4_fp8", "bf16", 65 * 576),          # 64 x 584 = 37,376 B padded up to a multiple of 576
    ("v4_mxfp8", "bf16", 64 * 528),        # 33,792 = 66 x 512: no padding
])
def test_v4_layer_bytes(kv_format, cache_dtype, page):
    csa = planner.v4_layer_bytes(V4_FLASH, "csa", kv_format, cache_dtype, block_size=64)
    hca = planner.v4_layer_bytes(V4_FLASH, "hca", kv_format, cache_dtype, block_size=64)
    window = planner.v4_layer_bytes(V4_FLASH, "window", kv_format, cache_dtype, block_size=64)
    for lb in (csa, hca, window):
        assert lb.window_bytes == 2 * page                             # the 128-token ring: 2 pages of 64
    assert (csa.ratio, csa.page_bytes, csa.index_page_bytes) == (4, page, 64 * 132)
    assert (hca.ratio, hca.page_bytes, hca.index_page_bytes) == (128, page, 0)
    assert (window.ratio, window.page_bytes, window.state_bytes) == (0, 0, 0)
    # fp32 kv and gate of the open window (CSA: 2 series + the previous window's first series), CSA's indexer too
    assert csa.state_bytes == 2 * 4 * (1_024 + 512) * 4 + 2 * 4 * (256 + 128) * 4 == 61_440
    assert hca.state_bytes == 2 * 128 * 512 * 4 == 524_288


def test_v4_flash_plan_by_hand():
    p = plan(V4_FLASH, 80 * GIB, 160e9, tp=2, kv_format="v4_fp8")
    lp = p.layouts["latent"]
    page = 65 * 576
    # a block spans 64 x 128 = 8,192 tokens: 32 pages of entries and of index keys per CSA layer, 1 per HCA layer
    per_block = 21 * 32 * (page + 64 * 132) + 20 * page
    assert (lp.tokens_per_block, lp.bytes_per_block) == (8_192, per_block) == (8_192, 31_585_536)
    assert lp.index_bytes_per_token == 21 * 132 // 4 == 693
    assert lp.bytes_per_token == -(-per_block // 8_192) == 3_856        # the notes' ~3.8 KiB per token
    assert lp.sequence_bytes == 43 * 2 * page + 21 * 61_440 + 20 * 524_288
    free = 80 * GIB - 80_000_000_000 - 2 * GIB
    assert p.free_bytes == free and p.cache_bytes == int(free * 0.8)
    assert lp.num_blocks == (p.cache_bytes - lp.sequence_bytes) // per_block
    assert lp.max_tokens == lp.num_blocks * 8_192 and lp.truncated == (lp.max_tokens < 1_048_576)


def test_v4_formats_mtp_and_errors():
    plans = planner.plan_kv_formats(V4_PRO, 141 * GIB, 865e9, tp=8, cache_dtype="bf16")
    assert [q.kv_format for q in plans] == [None, "v4_fp8", "v4_mxfp8"]
    tokens = [q.layouts["latent"].max_tokens for q in plans]
    assert tokens[0] < tokens[1] < tokens[2]                              # 1,024 > 584 > 528 B rows
    plain = plan(V4_PRO, 141 * GIB, 865e9, tp=8, cache_dtype="bf16").layouts["latent"]
    with_mtp = plan(V4_PRO, 141 * GIB, 865e9, tp=8, cache_dtype="bf16", count_mtp_layers=True).layouts["latent"]
    assert with_mtp.num_cached_layers == 62 and with_mtp.bytes_per_block == plain.bytes_per_block
    assert with_mtp.sequence_bytes == plain.sequence_bytes + 2 * 64 * 1_024   # one more window ring
    with pytest.raises(ValueError, match="^kv_format"):
        plan(V4_FLASH, 80 * GIB, 1e9, kv_format="fp8")
    with pytest.raises(ValueError, match="^cache_dtype"):
        plan(V4_FLASH, 80 * GIB, 1e9, cache_dtype="fp32")
    with pytest.raises(ValueError, match="^tp"):
        plan(V4_FLASH, 80 * GIB, 1e9, tp=3)
    with pytest.raises(ValueError, match="layer_types"):
        planner.V4Model("x", num_heads=1, max_context=1, layer_types=("mla",))


def test_v4_json_and_table():
    p = plan(V4_FLASH, 80 * GIB, 160e9, tp=2)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["model"]["attention"] == "v4" and d["model"]["layer_types"][:3] == ["window", "window", "csa"]
    assert d["latent"]["sequence_bytes"] == p.layouts["latent"].sequence_bytes > 0
    assert "sequence_bytes" not in plan(GLM, 32 * GIB, 18.4e9).to_dict()["latent"]   # others' JSON unchanged
    table = planner.format_plan(p, "h100")
    assert "2 window-only, 21 CSA" in table and "8,192 tokens" in table and "expanded" not in table


# The fields of deepseek-ai/DeepSeek-V4-Flash-Base's config.json that the planner reads, and a few others: per-layer
# compress_ratios (2 window-only layers, then CSA / HCA in turn, and a 0 for the MTP layer), no layer_types and no
# compress_rates.
V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]
V4_FLASH_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1, "compress_ratios": V4_FLASH_RATIOS,
}
HF_V4_LAYER_TYPES = {kind: hf for hf, kind in planner.V4_HF_LAYER_TYPES.items()}


def _v4_plans(model):
    """Every plan of a V4 model that the options change, as JSON with the model's name left out."""
    plans = []
    for kwargs in ({}, {"count_mtp_layers": True}, {"tp": 8, "cp": 2, "block_size": 16, "cache_dtype": "fp16"}):
        for q in planner.plan_kv_formats(model, 141 * GIB, 300e9, **kwargs):
            d = q.to_dict()
            del d["model"]["name"]
            plans.append(d)
    return plans


@pytest.mark.parametrize("preset, hf_kwargs", [
    # HF DeepseekV4Config's defaults are V4-Flash's sizes; its default layer schedule is not (3 HCA layers first)
    ("deepseek-v4-flash", dict(compress_ratios=V4_FLASH_RATIOS)),
    # Pro's sizes; its layer types in the preset's order (the plan counts them only)
    ("deepseek-v4-pro", dict(num_hidden_layers=61, num_attention_heads=128, index_topk=1024,
                             layer_types=[HF_V4_LAYER_TYPES[t] for t in V4_PRO.layer_types])),
])
def test_v4_configs_written_by_transformers_plan_as_the_presets(tmp_path, preset, hf_kwargs):
    from transformers import DeepseekV4Config

    expected = planner.MODELS[preset]
    config = DeepseekV4Config(**hf_kwargs)
    model = planner.model_from_hf_config(config.to_dict())
    assert dataclasses.replace(model, name=preset) == expected
    assert _v4_plans(model) == _v4_plans(expected)
    config.save_pretrained(tmp_path)                       # a checkpoint folder, as `mla-kv plan --model` reads it
    assert _v4_plans(load_model(str(tmp_path))) == _v4_plans(expected)


def test_load_v4_published_config(tmp_path):
    model = load_model(str(_write(tmp_path, V4_FLASH_CONFIG)))
    assert dataclasses.replace(model, name="deepseek-v4-flash") == V4_FLASH
    assert _v4_plans(model) == _v4_plans(V4_FLASH)
    # the layer list without the MTP layer's entry, and HF's own keys for the types and their ratios
    short = dict(V4_FLASH_CONFIG, compress_ratios=V4_FLASH_RATIOS[:43])
    assert load_model(str(_write(tmp_path, short))).layer_types == V4_FLASH.layer_types
    hf_keys = {k: v for k, v in V4_FLASH_CONFIG.items() if k != "compress_ratios"}
    hf_keys.update(layer_types=["sliding_attention"] + ["heavily_compressed_attention"] * 2, num_hidden_layers=3,
                   compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 64})
    model = load_model(str(_write(tmp_path, hf_keys)))
    assert (model.layer_types, model.csa_ratio, model.hca_ratio) == (("window", "hca", "hca"), 8, 64)
    legacy = dict(V4_FLASH_CONFIG, compress_ratios=[0, 8, 256, 0], num_hidden_layers=3, compress_rate_csa=8,
                  compress_rate_hca=256)
    model = load_model(str(_write(tmp_path, legacy)))
    assert (model.layer_types, model.csa_ratio, model.hca_ratio) == (("window", "csa", "hca"), 8, 256)


@pytest.mark.parametrize("extra, error, key", [
    ({"compress_ratios": None}, ValueError, "'layer_types' (or 'compress_ratios')"),
    ({"index_topk": None}, ValueError, "'index_topk'"),
    ({"sliding_window": 128.0}, TypeError, "'sliding_window'"),
    ({"index_n_heads": "64"}, TypeError, "'index_n_heads'"),
    ({"compress_ratios": V4_FLASH_RATIOS[:42]}, ValueError, "'compress_ratios' must list 43 or 44 layers"),
    ({"compress_ratios": V4_FLASH_RATIOS + [0]}, ValueError, "'compress_ratios' must list 43 or 44 layers"),
    ({"compress_ratios": [0, 8] + V4_FLASH_RATIOS[2:]}, ValueError, "'compress_ratios'[1]: 8"),
    ({"compress_ratios": [0.0] + V4_FLASH_RATIOS[1:]}, TypeError, "'compress_ratios'[0]"),
    ({"layer_types": ["sliding_attention"] * 42 + ["full_attention"]}, ValueError, "'layer_types'[42]"),
    ({"layer_types": ["sliding_attention"] * 3}, ValueError, "'layer_types' must list 43 or 44 layers"),
    ({"compress_rates": {"compressed_sparse_attention": 4}}, ValueError,
     "'compress_rates'['heavily_compressed_attention']"),
    ({"compress_rates": [4, 128]}, ValueError, "'compress_rates'"),
    ({"compress_rate_csa": 0}, ValueError, "'compress_rate_csa'"),
    ({"compress_rate_csa": 128}, ValueError, "'compress_ratios' cannot tell"),
    ({"compress_rate_hca": 6, "layer_types": ["sliding_attention"] * 43}, ValueError, "'compress_rate_hca'"),
])
def test_bad_v4_configs_name_the_file_and_the_key(tmp_path, extra, error, key):
    path = _write(tmp_path, dict(V4_FLASH_CONFIG, **extra))
    with pytest.raises(error) as info:
        load_model(str(path))
    assert str(info.value).startswith(f"{path}: ") and key in str(info.value)
