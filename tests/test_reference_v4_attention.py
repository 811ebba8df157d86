"""reference.v4_attention.v4_sparse_attention (DeepSeek-V4 attention) on the CPU.

Against a direct float64 computation written here (the selected rows gathered one slot at a time, then a
softmax over their logits with the sink as an explicit extra column): sinks 0 / per-head / large / -inf /
+inf, one and two sets, -1 padding, slots past the cache, lengths, repeats, a width-0 set, a token with no
row, a reader callable in place of a cache. Against reference.sparse_attention (no sink, one set) on the
same indices, the 512-wide rows zero-padded to its 576. The de-rotation as the inverse of
reference.write.apply_rope; the argument checks. And against HF transformers' DeepseekV4Attention: a
tiny random sliding-window layer in float64, its q and K=V rows fed to the reference from a paged cache,
whose output (de-rotated, then through HF's own output projections) must equal the layer's.
"""
import pytest
import torch

from mla_kv import reference, rope
from mla_kv.reference.v4_attention import v4_sparse_attention

DIM = 512
SCALE = DIM ** -0.5
NO_ROW = -1


def _random_cache(blocks: int, page: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(blocks, page, DIM, dtype=torch.float64).to(dtype)


def _selected_rows(cache: torch.Tensor, indices: torch.Tensor, lengths, t: int) -> torch.Tensor:
    """The rows token t reads, one slot at a time: slots in [0, capacity) among its first lengths[t]."""
    flat = cache.reshape(-1, DIM).to(torch.float64)
    count = indices.shape[1] if lengths is None else min(max(int(lengths[t]), 0), indices.shape[1])
    rows = [flat[s] for s in indices[t, :count].tolist() if 0 <= s < flat.shape[0]]
    return torch.stack(rows) if rows else torch.zeros(0, DIM, dtype=torch.float64)


def _direct(q: torch.Tensor, sets, sink) -> tuple:
    """out [T, H, 512], lse [T, H] float64 by the softmax over [logits | sink] of each token's rows."""
    tokens, heads, _ = q.shape
    out = torch.zeros(tokens, heads, DIM, dtype=torch.float64)
    lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float64)
    for t in range(tokens):
        rows = torch.cat([_selected_rows(cache, idx, lens, t) for cache, idx, lens in sets])
        if rows.shape[0] == 0:
            continue
        for h in range(heads):
            logits = SCALE * rows @ q[t, h].to(torch.float64)
            lse[t, h] = torch.logsumexp(logits, 0)
            sink_h = float("-inf") if sink is None else float(sink[h])
            if sink_h == float("inf"):
                continue  # the sink takes all the weight
            weights = torch.softmax(torch.cat([logits, torch.tensor([sink_h], dtype=torch.float64)]), 0)[:-1]
            out[t, h] = weights @ rows
    return out, lse


def _check(q, sets, sink=None, **tolerance):
    out, lse = v4_sparse_attention(q, sets, SCALE, attn_sink=sink)
    want_out, want_lse = _direct(q, sets, sink)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.to(torch.float64), want_out, **tolerance)
    torch.testing.assert_close(lse, want_lse.float())
    return out, lse


def _two_sets(tokens: int = 5):
    """A window set (cache A, page 4) and a compressed set (cache B, page 8) covering the odd cases:
    token 0 reads -1 padding and a slot past A; token 1 repeats a slot; token 2 is cut by lengths;
    token 3 reads nothing from either set; token 4 reads only the compressed set."""
    window_cache, compressed_cache = _random_cache(3, 4), _random_cache(2, 8)
    window = torch.tensor([[0, NO_ROW, 5, 12],   # 12 = 3 * 4 is past cache A
                           [7, 7, 2, NO_ROW],
                           [1, 2, 3, 4],
                           [NO_ROW, NO_ROW, NO_ROW, NO_ROW],
                           [NO_ROW, 9, 9, 9]], dtype=torch.int32)[:tokens]
    window_lens = torch.tensor([4, 3, 2, 4, 0], dtype=torch.int32)[:tokens]
    compressed = torch.tensor([[3, 15, NO_ROW],
                               [0, 1, 2],
                               [NO_ROW, 10, 4],
                               [NO_ROW, 20, 21],
                               [11, 11, 5]], dtype=torch.int32)[:tokens]
    compressed_lens = torch.tensor([3, 2, 3, 1, 3], dtype=torch.int32)[:tokens]
    return [(window_cache, window, window_lens), (compressed_cache, compressed, compressed_lens)]


SINKS = {  # name -> per-head sinks for 4 heads (None: no sink)
    "none": None,
    "zero": torch.zeros(4),
    "per-head": torch.tensor([-2.0, 0.5, 3.0, 8.0]),
    "large": torch.full((4,), 1e4),
    "minus-inf": torch.full((4,), float("-inf")),
    "plus-inf": torch.full((4,), float("inf")),
    "mixed-inf": torch.tensor([float("-inf"), 1.0, float("inf"), 40.0]),
}


@pytest.mark.parametrize("sink_name", list(SINKS))
@pytest.mark.parametrize("set_count", [1, 2])
def test_against_direct_softmax_with_sink(sink_name, set_count):
    sets = _two_sets()[:set_count]
    q = torch.randn(5, 4, DIM, dtype=torch.float64) * 2
    out, lse = _check(q, sets, SINKS[sink_name])
    # Token 3 reads no row from either set: out 0 and lse -inf whatever the sink.
    assert (out[3] == 0).all() and (lse[3] == float("-inf")).all()
    if sink_name in ("large", "plus-inf"):
        assert (out == 0).all()
    # lse leaves the sink out: it is the same with or without one.
    torch.testing.assert_close(lse, v4_sparse_attention(q, sets, SCALE)[1])


def test_sink_scales_the_no_sink_output():
    """FlashMLA's form: out(sink) = out(no sink) / (1 + exp(sink - lse))."""
    sets = _two_sets()
    q = torch.randn(5, 4, DIM, dtype=torch.float64)
    sink = SINKS["per-head"]
    plain, lse = v4_sparse_attention(q, sets, SCALE)
    sunk, _ = v4_sparse_attention(q, sets, SCALE, attn_sink=sink)
    factor = torch.where(lse == float("-inf"), 0.0, 1 / (1 + torch.exp(sink.double() - lse.double())))
    torch.testing.assert_close(sunk, plain * factor[..., None])
    assert (factor[[0, 1, 2, 4]] < 1).all() and (factor[[0, 1, 2, 4]] > 0).all()


def test_two_sets_share_one_softmax():
    """Two sets are one softmax, not two averaged: the same as one set holding both sets' rows."""
    window, compressed = _two_sets()
    q = torch.randn(5, 4, DIM, dtype=torch.float64)
    sink = SINKS["per-head"]
    merged_cache = torch.cat([window[0].reshape(-1, DIM), compressed[0].reshape(-1, DIM)])[None]
    offset = window[0].shape[0] * window[0].shape[1]
    pieces, pieces_lens = [], []
    for t in range(5):  # each token's surviving slots of both sets, moved into the merged cache
        slots = [s for s in window[1][t, :int(window[2][t])].tolist() if 0 <= s < offset]
        slots += [s + offset for s in compressed[1][t, :int(compressed[2][t])].tolist() if 0 <= s < 16]
        pieces.append(slots)
        pieces_lens.append(len(slots))
    width = max(pieces_lens)
    merged = torch.tensor([p + [NO_ROW] * (width - len(p)) for p in pieces], dtype=torch.int32)
    both = v4_sparse_attention(q, [window, compressed], SCALE, attn_sink=sink)
    one = v4_sparse_attention(q, [(merged_cache, merged, None)], SCALE, attn_sink=sink)
    torch.testing.assert_close(both, one)
    separate = v4_sparse_attention(q, [window], SCALE, attn_sink=sink)[0]
    assert not torch.allclose(both[0][0], separate[0])


def test_width_zero_set_adds_nothing():
    window, _ = _two_sets()
    empty = (_random_cache(1, 4), torch.zeros(5, 0, dtype=torch.int32), None)
    q = torch.randn(5, 4, DIM, dtype=torch.float64)
    sink = SINKS["per-head"]
    with_empty = v4_sparse_attention(q, [window, empty], SCALE, attn_sink=sink)
    torch.testing.assert_close(with_empty, v4_sparse_attention(q, [window], SCALE, attn_sink=sink))
    _check(q, [empty, window], sink)
    out, lse = v4_sparse_attention(q, [empty], SCALE, attn_sink=sink)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_repeats_count_again():
    cache = _random_cache(1, 4)
    q = torch.randn(1, 2, DIM, dtype=torch.float64)
    once = v4_sparse_attention(q, [(cache, torch.tensor([[0, 1]]), None)], SCALE)
    twice = v4_sparse_attention(q, [(cache, torch.tensor([[0, 1, 1]]), None)], SCALE)
    # Row 1 twice: its weight doubles against row 0's, and the sum gains log(1 + w1).
    assert not torch.allclose(once[0], twice[0])
    _check(q, [(cache, torch.tensor([[0, 1, 1]]), None)])


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cache_dtypes_and_q_dtype(cache_dtype):
    window, compressed = _two_sets()
    sets = [(window[0].to(cache_dtype),) + window[1:], (compressed[0].to(cache_dtype),) + compressed[1:]]
    q = torch.randn(5, 4, DIM, dtype=torch.float64)
    _check(q, sets, SINKS["per-head"])  # the direct form reads the same rounded rows
    out, lse = v4_sparse_attention(q.to(cache_dtype), sets, SCALE)
    assert out.dtype == cache_dtype and lse.dtype == torch.float32


def test_reader_callable_matches_cache_tensor():
    """A callable slots -> rows (how a quantized V4 cache plugs in) reads the same rows, once per set."""
    window, compressed = _two_sets()
    calls = []

    def read_compressed(slots):
        calls.append(slots.clone())
        assert (slots >= 0).all()
        capacity = compressed[0].shape[0] * compressed[0].shape[1]
        flat = compressed[0].reshape(-1, DIM)
        # Past the cache: a NaN row that, read, would show in the output.
        return torch.where((slots < capacity)[:, None], flat[slots.clamp(max=capacity - 1)], float("nan"))

    # The reader gets every slot >= 0 (slots past a cache are its own business): keep them in range here.
    in_range = compressed[1].clamp(max=15)
    q = torch.randn(5, 4, DIM, dtype=torch.float64)
    sink = SINKS["per-head"]
    via_reader = v4_sparse_attention(q, [window, (read_compressed, in_range, compressed[2])], SCALE, attn_sink=sink)
    via_tensor = v4_sparse_attention(q, [window, (compressed[0], in_range, compressed[2])], SCALE, attn_sink=sink)
    torch.testing.assert_close(via_reader, via_tensor)
    assert len(calls) == 1


def test_matches_sparse_attention_without_sink():
    """One set, no sink: reference.sparse_attention on the same indices and lengths, with each 512-wide row
    and query zero-padded to its 576 (the padding adds 0 to every logit; its values are the first 512)."""
    cache, indices, lengths = _two_sets()[0]
    q = torch.randn(5, 4, DIM, dtype=torch.float64)
    padded_cache = torch.cat([cache, torch.zeros(*cache.shape[:2], 64, dtype=cache.dtype)], dim=-1)
    padded_q = torch.cat([q, torch.zeros(5, 4, 64, dtype=q.dtype)], dim=-1)
    want_out, want_lse = reference.sparse_attention(padded_q, padded_cache, indices, SCALE, topk_lens=lengths)
    out, lse = v4_sparse_attention(q, [(cache, indices, lengths)], SCALE)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse.float())
    # the same without lengths (every index read)
    want_out, _ = reference.sparse_attention(padded_q, padded_cache, indices, SCALE)
    torch.testing.assert_close(v4_sparse_attention(q, [(cache, indices, None)], SCALE)[0], want_out)


def test_derotate_inverts_apply_rope():
    """A token that reads one row gets that row back; with derotate, its trailing 64 dims come back to what they
    were before reference.write.apply_rope rotated them at the token's position (the leading 448 untouched)."""
    tokens, heads = 4, 3
    table = rope.cos_sin_cache(64, 100, theta=10000.0, dtype=torch.float64)
    positions = torch.tensor([0, 7, 31, 99])
    plain = torch.randn(tokens, DIM, dtype=torch.float64)
    rotated = torch.cat([plain[:, :-64], reference.apply_rope(plain[:, -64:], positions, table)], dim=-1)
    assert not torch.allclose(rotated[1:, -64:], plain[1:, -64:])
    cache = rotated.reshape(tokens, 1, DIM)
    indices = torch.arange(tokens, dtype=torch.int32)[:, None]
    q = torch.randn(tokens, heads, DIM, dtype=torch.float64)
    out, _ = v4_sparse_attention(q, [(cache, indices, None)], SCALE, derotate=(positions, table))
    torch.testing.assert_close(out, plain[:, None, :].expand(-1, heads, -1))
    kept, _ = v4_sparse_attention(q, [(cache, indices, None)], SCALE)
    torch.testing.assert_close(kept, rotated[:, None, :].expand(-1, heads, -1))


def test_writes_into_out_and_lse():
    sets = _two_sets()
    q = torch.randn(5, 4, DIM, dtype=torch.float32)
    out, lse = torch.full_like(q, float("nan")), torch.full((5, 4), float("nan"))
    got_out, got_lse = v4_sparse_attention(q, sets, SCALE, attn_sink=SINKS["per-head"], out=out, lse=lse)
    assert got_out is out and got_lse is lse
    want_out, want_lse = v4_sparse_attention(q, sets, SCALE, attn_sink=SINKS["per-head"])
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


def _bad_cases():
    cache, indices, lengths = _two_sets()[0]
    q = torch.randn(5, 4, DIM)
    good = (cache, indices, lengths)
    table = rope.cos_sin_cache(64, 16, theta=10000.0)
    positions = torch.arange(5)
    return {  # name -> (call arguments, keyword arguments, the argument the message names)
        "q-dims": ((q[0], [good]), {}, "q"),
        "q-width-576": ((torch.randn(5, 4, 576), [good]), {}, "q"),
        "q-int": ((q.long(), [good]), {}, "q"),
        "no-sets": ((q, []), {}, "sets"),
        "three-sets": ((q, [good] * 3), {}, "sets"),
        "set-not-a-triple": ((q, [(cache, indices)]), {}, r"sets\[0\]"),
        "cache-width-576": ((q, [good, (torch.randn(2, 4, 576), indices, None)]), {}, r"sets\[1\] rows_source"),
        "cache-int": ((q, [(cache.long(), indices, None)]), {}, r"sets\[0\] rows_source"),
        "cache-not-a-tensor": ((q, [("cache", indices, None)]), {}, r"sets\[0\] rows_source"),
        "reader-wrong-rows": ((q, [(lambda slots: torch.zeros(1, DIM), indices, None)]), {}, r"sets\[0\] rows_source"),
        "indices-float": ((q, [(cache, indices.float(), None)]), {}, r"sets\[0\] indices"),
        "indices-rows": ((q, [(cache, indices[:4], None)]), {}, r"sets\[0\] indices"),
        "lengths-shape": ((q, [(cache, indices, lengths[:3])]), {}, r"sets\[0\] lengths"),
        "scale-zero": ((q, [good], 0.0), {}, "softmax_scale"),
        "sink-shape": ((q, [good]), {"attn_sink": torch.zeros(3)}, "attn_sink"),
        "sink-int": ((q, [good]), {"attn_sink": torch.zeros(4, dtype=torch.int32)}, "attn_sink"),
        "derotate-not-a-pair": ((q, [good]), {"derotate": positions}, "derotate"),
        "derotate-positions-range": ((q, [good]), {"derotate": (positions + 12, table)}, "derotate positions"),
        "derotate-table-width": ((q, [good]), {"derotate": (positions, table[:, :32])}, "derotate cos_sin_cache"),
        "out-shape": ((q, [good]), {"out": torch.zeros(5, 4, 64)}, "out"),
        "lse-dtype": ((q, [good]), {"lse": torch.zeros(5, 4, dtype=torch.float64)}, "lse"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input(case):
    args, kwargs, name = _bad_cases()[case]
    if len(args) == 2:
        args = args + (SCALE,)
    with pytest.raises((ValueError, TypeError), match=f"^{name}"):
        v4_sparse_attention(*args, **kwargs)


# ------------------------------------------------------------------------------- HF transformers
WINDOW = 4


def _hf_layer():
    """A random float64 sliding-window DeepseekV4Attention (4 heads of 512, window 4), its rotary and config."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(hidden_size=64, num_attention_heads=4, head_dim=DIM, q_lora_rank=32, o_groups=2,
                              o_lora_rank=16, num_hidden_layers=1, layer_types=["sliding_attention"],
                              mlp_layer_types=["moe"], sliding_window=WINDOW, max_position_embeddings=64)
    config._attn_implementation = "eager"  # the reference softmax with the sink column
    attention = modeling.DeepseekV4Attention(config, 0).double().eval()
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.normal_(std=0.2)
        attention.sinks.normal_(std=2.0)
    return modeling, attention, modeling.DeepseekV4RotaryEmbedding(config)


def _hf_forward(modeling, attention, hidden, cos, sin):
    """The layer's output, its attention output before the output projection, and its q and K=V rows (the same
    lines as DeepseekV4Attention.forward)."""
    tokens = hidden.shape[1]
    position = torch.arange(tokens)
    visible = (position[None, :] <= position[:, None]) & (position[None, :] > position[:, None] - WINDOW)
    mask = torch.zeros(tokens, tokens, dtype=torch.float64).masked_fill(~visible, float("-inf"))[None, None]
    seen = {}
    hook = attention.o_a_proj.register_forward_pre_hook(lambda module, args: seen.update(grouped=args[0]))
    with torch.no_grad():
        layer_out, _ = attention(hidden, {"main": (cos, sin)}, position[None], mask)
        q = attention.q_b_norm(attention.q_b_proj(attention.q_a_norm(attention.q_a_proj(hidden)))
                               .view(1, tokens, -1, DIM).transpose(1, 2))
        q = modeling.apply_rotary_pos_emb(q, cos, sin)
        kv = attention.kv_norm(attention.kv_proj(hidden)).view(1, tokens, -1, DIM).transpose(1, 2)
        kv = modeling.apply_rotary_pos_emb(kv, cos, sin)
    hook.remove()
    return layer_out[0], seen["grouped"][0].reshape(tokens, -1, DIM), q[0].transpose(0, 1), kv[0, 0]


@pytest.mark.parametrize("split", [False, True])
def test_matches_hf_deepseek_v4_sliding_layer(split):
    """HF's eager DeepseekV4Attention (window mask, per-head sinks, the -sin de-rotation of the output) against
    the reference fed HF's q and K=V rows from a paged cache with shuffled pages. split: the window's two
    oldest slots come as a second set from a second cache (one softmax over both must not change anything)."""
    modeling, attention, rotary = _hf_layer()
    tokens = 7
    hidden = torch.randn(1, tokens, 64, dtype=torch.float64)
    position = torch.arange(tokens)
    cos, sin = rotary(hidden, position[None], layer_type="main")                 # [1, T, 32] each
    layer_out, hf_attention, q, kv = _hf_forward(modeling, attention, hidden, cos, sin)

    page = 2
    pages = torch.randperm(4)                       # position p lives on page pages[p // page]
    slot = pages[position // page] * page + position % page
    cache = torch.zeros(4, page, DIM, dtype=torch.float64)
    cache.reshape(-1, DIM)[slot] = kv
    window = torch.full((tokens, WINDOW), NO_ROW, dtype=torch.int32)
    for t in range(tokens):
        seen = position[max(0, t - WINDOW + 1):t + 1]
        window[t, :len(seen)] = slot[seen].int()
    sets = [(cache, window, None)]
    if split:  # the older two of each full window move to a second cache of another page size
        older = torch.full((tokens, 2), NO_ROW, dtype=torch.int32)
        second_cache = torch.zeros(tokens, 1, DIM, dtype=torch.float64)
        second_cache[:, 0] = kv
        for t in range(WINDOW - 1, tokens):
            older[t] = torch.tensor([t - 3, t - 2], dtype=torch.int32)
        window = torch.where((torch.arange(WINDOW) < 2)[None, :] & (older[:, :1] >= 0), NO_ROW, window)
        sets = [(cache, window, None), (second_cache, older, torch.full((tokens,), 2))]
    table = torch.cat([cos[0], sin[0]], dim=-1)                                  # [T, 64] = [cos | sin]
    out, lse = v4_sparse_attention(q, sets, attention.scaling, attn_sink=attention.sinks.detach(),
                                   derotate=(position, table))
    # HF rounds the rotated slice's inputs to float32 (apply_rotary_pos_emb's .float()): ~1e-7 relative.
    torch.testing.assert_close(out, hf_attention, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        grouped = attention.o_a_proj(out.reshape(tokens, attention.config.o_groups, -1)).flatten(1)
        torch.testing.assert_close(attention.o_b_proj(grouped), layer_out, rtol=1e-5, atol=1e-6)
    # lse is the window's logsumexp, without the sink
    scores = attention.scaling * torch.einsum("thd,sd->ths", q, kv)
    visible = (position[None, :] <= position[:, None]) & (position[None, :] > position[:, None] - WINDOW)
    want_lse = torch.logsumexp(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    torch.testing.assert_close(lse, want_lse.float())
