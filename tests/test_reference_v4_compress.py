"""mla_kv.reference.v4_compress against HF transformers' DeepSeek-V4 compressors, and its decode form against its
prefill form."""
import pytest
import torch

from mla_kv.reference.v4_compress import CompressorState, compress_prefill, compress_step
from mla_kv.rope import cos_sin_cache

HEAD_DIM = 128          # 64 NoPE + 64 RoPE: the smallest width whose trailing 64 values are the rope part
MAX_POSITION = 4096


def _hf():
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    return modeling, DeepseekV4Config


def _config(layer_type: str, hca_ratio: int = 128):
    _, config_class = _hf()
    return config_class(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=HEAD_DIM, q_lora_rank=16,
        index_n_heads=2, index_head_dim=HEAD_DIM, index_topk=4, partial_rotary_factor=64 / HEAD_DIM,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_ratio},
        max_position_embeddings=MAX_POSITION, layer_types=[layer_type],
        # V4's compress rope: YaRN factor 16 (original context scaled down with the tiny max position).
        rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": MAX_POSITION // 16})


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 1.0 if "bias" in name or "norm" in name else 0.3
            offset = 1.0 if "norm" in name else 0.0
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale + offset)


def _cos_sin_cache(compressor) -> torch.Tensor:
    """HF's compress rotary as mla_kv's table: [cos (32) | sin (32)] per position."""
    positions = torch.arange(MAX_POSITION)[None]
    cos, sin = compressor.rotary_emb(torch.zeros(1, dtype=torch.float32), position_ids=positions,
                                     layer_type="compress")
    return torch.cat([cos[0], sin[0]], dim=-1)


class _Cache:
    """The one-layer cache object HF's compressors read (``cache.layers[layer_idx]``)."""

    def __init__(self, layer):
        self.layers = [layer]


def _hca(hca_ratio=128, seed=0):
    modeling, _ = _hf()
    config = _config("heavily_compressed_attention", hca_ratio)
    compressor = modeling.DeepseekV4HCACompressor(config).float().eval()
    _randomize(compressor, seed)
    return modeling, config, compressor


def _csa(seed=0):
    modeling, _ = _hf()
    config = _config("compressed_sparse_attention")
    compressor = modeling.DeepseekV4CSACompressor(config).float().eval()
    _randomize(compressor, seed)
    return modeling, config, compressor


def _args(compressor):
    return dict(bias=compressor.position_bias.detach(), rms_weight=compressor.kv_norm.weight.detach(),
                eps=compressor.kv_norm.variance_epsilon, cos_sin_cache=_cos_sin_cache(compressor))


def _hidden(tokens, seed=1):
    return torch.randn(1, tokens, 32, generator=torch.Generator().manual_seed(seed))


def _projections(compressor, hidden):
    with torch.no_grad():
        return compressor.kv_proj(hidden)[0], compressor.gate_proj(hidden)[0]


def _call(compressor, hidden, start, cache):
    positions = torch.arange(start, start + hidden.shape[1])[None]
    q_residual = torch.zeros(1, hidden.shape[1], 16)
    with torch.no_grad():
        return compressor(hidden, q_residual, positions, cache, 0)[0][0, 0]   # [entries, head_dim]


# ------------------------------------------------------------------------------------- against HF
@pytest.mark.parametrize("kind, ratio, tokens", [
    *(("hca", 128, t) for t in (127, 128, 300, 512)), *(("csa", 4, t) for t in (3, 4, 9, 16, 37))])
def test_prefill_matches_hf(kind, ratio, tokens):
    _, _, compressor = _hca() if kind == "hca" else _csa()
    hidden = _hidden(tokens)
    expected = _call(compressor, hidden, 0, None)
    kv, gate = _projections(compressor, hidden)
    got = compress_prefill(kind, kv, gate, **_args(compressor))
    assert got.shape == (tokens // ratio, HEAD_DIM) == expected.shape
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
    got64 = compress_prefill(kind, kv.double(), gate.double(), **_args(compressor))
    assert got64.dtype == torch.float64
    torch.testing.assert_close(got64.float(), expected, rtol=2e-5, atol=2e-5)



def test_csa_entry_mixes_previous_series_a_and_own_series_b():
    # The spec, spelled out for entry 1 of 2 windows, independent of HF: its slots are window 0's series a and
    # window 1's series b, each gate plus the bias row of the token's offset in its window.
    _, _, compressor = _csa()
    args = _args(compressor)
    kv, gate = _projections(compressor, _hidden(8))
    kv, gate = kv.double(), gate.double()
    bias = args["bias"].double()
    slots_kv = torch.cat([kv[0:4, :HEAD_DIM], kv[4:8, HEAD_DIM:]])
    slots_logit = torch.cat([gate[0:4, :HEAD_DIM] + bias[:, :HEAD_DIM], gate[4:8, HEAD_DIM:] + bias[:, HEAD_DIM:]])
    pooled = (torch.softmax(slots_logit, dim=0) * slots_kv).sum(0)
    normed = pooled * torch.rsqrt(pooled.pow(2).mean() + args["eps"]) * args["rms_weight"].double()
    cos, sin = args["cos_sin_cache"][4, :32].double(), args["cos_sin_cache"][4, 32:].double()
    even, odd = normed[64::2], normed[65::2]
    rope = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten()
    expected = torch.cat([normed[:64], rope])
    got = compress_prefill("csa", kv, gate, **args)
    torch.testing.assert_close(got[1], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind, chunks", [("csa", [3, 1, 6, 2, 9]), ("csa", [4, 4, 8]), ("hca", [5, 3, 16, 1, 7])])
def test_chunked_prefill_matches_hf_cache(kind, chunks):
    # HF's cached path carries the open window and CSA's overlap across calls: so must the state.
    modeling, config, compressor = _csa() if kind == "csa" else _hca(hca_ratio=8)
    layer = (modeling.DeepseekV4CSACache if kind == "csa" else modeling.DeepseekV4HCACache)(config)
    cache = _Cache(layer)
    args = _args(compressor)
    hidden = _hidden(sum(chunks))
    state = CompressorState.empty(kind, args["bias"].shape[0], HEAD_DIM)
    start, emitted = 0, []
    for size in chunks:
        piece = hidden[:, start:start + size]
        _call(compressor, piece, start, cache)
        kv, gate = _projections(compressor, piece)
        emitted.append(compress_prefill(kind, kv, gate, **args, state=state))
        start += size
    expected = layer.compressed_kv["compressor"][0]
    torch.testing.assert_close(torch.cat(emitted), expected, rtol=2e-5, atol=2e-5)
    assert state.next_position == sum(chunks)


def test_csa_at_index_width_matches_hf_indexer_keys():
    # The indexer's compressor is CSA's at index_head_dim: its keys are compress_prefill("csa") of its projections.
    modeling, config, compressor = _csa()
    cache = _Cache(modeling.DeepseekV4CSACache(config))
    hidden = _hidden(13)
    _call(compressor, hidden, 0, cache)
    indexer = compressor.indexer
    kv, gate = _projections(indexer, hidden)
    got = compress_prefill("csa", kv, gate, bias=indexer.position_bias.detach(),
                           rms_weight=indexer.kv_norm.weight.detach(), eps=indexer.kv_norm.variance_epsilon,
                           cos_sin_cache=_cos_sin_cache(indexer))
    torch.testing.assert_close(got, cache.layers[0].compressed_kv["indexer"][0], rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- decode == prefill
def _random_case(kind, tokens, ratio, seed=3):
    series = 2 if kind == "csa" else 1
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(tokens, series * HEAD_DIM, generator=gen, dtype=torch.float64)
    gate = torch.randn(tokens, series * HEAD_DIM, generator=gen, dtype=torch.float64) * 2
    args = dict(bias=torch.randn(ratio, series * HEAD_DIM, generator=gen, dtype=torch.float64),
                rms_weight=torch.rand(HEAD_DIM, generator=gen, dtype=torch.float64) + 0.5, eps=1e-6,
                cos_sin_cache=cos_sin_cache(64, MAX_POSITION, theta=160000.0, dtype=torch.float64))
    return kv, gate, args


@pytest.mark.parametrize("kind, ratio, tokens", [("csa", 4, 23), ("csa", 4, 24), ("hca", 128, 300), ("hca", 8, 41)])
def test_step_by_step_equals_prefill(kind, ratio, tokens):
    kv, gate, args = _random_case(kind, tokens, ratio)
    whole = compress_prefill(kind, kv, gate, **args)
    state = CompressorState.empty(kind, ratio, HEAD_DIM, dtype=torch.float64)
    stepped = []
    for t in range(tokens):
        entry = compress_step(state, kv[t], gate[t], t, **args)
        assert (entry is not None) == ((t + 1) % ratio == 0), t
        if entry is not None:
            stepped.append(entry)
    assert len(stepped) == tokens // ratio
    torch.testing.assert_close(torch.stack(stepped), whole, rtol=1e-12, atol=1e-12)
    assert state.open_tokens == tokens % ratio and state.entries == tokens // ratio


@pytest.mark.parametrize("split", [5, 8, 10])
def test_csa_prefill_then_decode_equals_prefill_of_the_whole(split):
    # The overlap: entry split // 4 (or the next) mixes series a of a window closed in the prefill call.
    kv, gate, args = _random_case("csa", 22, 4)
    whole = compress_prefill("csa", kv, gate, **args)
    state = CompressorState.empty("csa", 4, HEAD_DIM, dtype=torch.float64)
    first = compress_prefill("csa", kv[:split], gate[:split], **args, state=state)
    rest = [compress_step(state, kv[t], gate[t], t, **args) for t in range(split, 22)]
    got = torch.cat([first, torch.stack([e for e in rest if e is not None])])
    torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)


def test_csa_without_the_previous_series_differs():
    # Guards the test above: a state that forgot series a of the last window gives other entries.
    kv, gate, args = _random_case("csa", 12, 4)
    whole = compress_prefill("csa", kv, gate, **args)
    state = CompressorState.empty("csa", 4, HEAD_DIM, dtype=torch.float64)
    compress_prefill("csa", kv[:4], gate[:4], **args, state=state)
    state.has_prev = False
    after = compress_prefill("csa", kv[4:8], gate[4:8], **args, state=state)
    assert not torch.allclose(after[0], whole[1])


def test_float32_state_computes_in_float32():
    kv, gate, args = _random_case("csa", 16, 4)
    whole = compress_prefill("csa", kv, gate, **args)
    state = CompressorState.empty("csa", 4, HEAD_DIM)
    got = [compress_step(state, kv[t].bfloat16(), gate[t].bfloat16(), t, **args) for t in range(16)]
    got = torch.stack([e for e in got if e is not None])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), whole, rtol=0.05, atol=0.05)


# --------------------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument():
    kv, gate, args = _random_case("csa", 8, 4)
    with pytest.raises(ValueError, match="^kind"):
        compress_prefill("mla", kv, gate, **args)
    with pytest.raises(ValueError, match="^kv"):
        compress_prefill("csa", kv[:, :HEAD_DIM], gate, **args)
    with pytest.raises(ValueError, match="^gate"):
        compress_prefill("csa", kv, gate[:4], **args)
    with pytest.raises(ValueError, match="^bias"):
        compress_prefill("csa", kv, gate, **dict(args, bias=args["bias"][:, :100]))
    with pytest.raises(ValueError, match="^rms_weight"):
        compress_prefill("csa", kv, gate, **dict(args, rms_weight=args["rms_weight"][:64]))
    with pytest.raises(ValueError, match="^eps"):
        compress_prefill("csa", kv, gate, **dict(args, eps=0.0))
    with pytest.raises(ValueError, match="^cos_sin_cache"):
        compress_prefill("csa", kv, gate, **dict(args, cos_sin_cache=args["cos_sin_cache"][:4]))
    with pytest.raises(TypeError, match="^kv"):
        compress_prefill("csa", kv.long(), gate, **args)
    state = CompressorState.empty("csa", 4, HEAD_DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match="^position"):
        compress_step(state, kv[0], gate[0], 1, **args)
    with pytest.raises(ValueError, match="^kv_t"):
        compress_step(state, kv[0, :HEAD_DIM], gate[0], 0, **args)
    with pytest.raises(ValueError, match="^state"):
        compress_prefill("hca", kv[:, :HEAD_DIM], gate[:, :HEAD_DIM], **dict(args, bias=args["bias"][:, :HEAD_DIM]),
                         state=state)
    with pytest.raises(TypeError, match="^state"):
        compress_step(None, kv[0], gate[0], 0, **args)
    with pytest.raises(ValueError, match="^width"):
        CompressorState.empty("csa", 4, 32)
