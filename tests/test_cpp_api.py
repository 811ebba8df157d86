"""Host-side checks of the C++ entry points, called through the bindings (no GPU needed: they
return before anything touches the device)."""
import pytest

from mla_kv import gpus, ops

_C = ops._C
pytestmark = pytest.mark.skipif(_C is None, reason="the package was built without kernels")


def paged_params(num_splits, tokens_per_split):
    p = _C.AttentionParams()
    p.dtype = _C.DType.float16
    p.batch, p.num_heads, p.q_len, p.total_q_tokens = 0, 16, 1, 0  # an empty batch: nothing to launch
    p.num_splits, p.tokens_per_split = num_splits, tokens_per_split
    return p


def test_attention_paged_refuses_splits_short_of_the_block_table():
    cache = _C.PagedCache(0, 4, 64, 64 * 576 * 2, _C.RowLayout(0, 512, 576 * 2))
    max_blocks = 4  # 256 positions
    with pytest.raises(RuntimeError, match="invalid argument"):
        _C.attention_paged(paged_params(1, 255), cache, 0, max_blocks, max_blocks, _C.Arch.auto, 0)
    try:  # covering splits pass the check (without a GPU the call then stops at the arch lookup)
        _C.attention_paged(paged_params(1, 256), cache, 0, max_blocks, max_blocks, _C.Arch.auto, 0)
    except RuntimeError as e:
        assert "invalid argument" not in str(e)


@pytest.mark.parametrize("gpu", list(gpus.gpu_classes()) if _C is not None else [])
def test_schedule_covers_the_context_in_one_wave(gpu):
    """Every GPU class's schedule (an explicit tag and limits need no device): the splits cover
    max_kv_len, none is empty, they end on 64-token tile boundaries, and split CTAs fit one wave of
    132 SMs holding the CTAs per SM the tiles allow."""
    g = gpus.gpu_classes()[gpu]
    tag, limits = getattr(_C.Arch, g.arch), gpus.c_limits(g.smem)
    sms = 132
    for batch in (0, 1, 3, 64, 512):  # 0: an empty batch (no CTAs) must not divide by its CTA count
        for heads in (1, 5, 16, 20, 64, 128):
            for q_len in (1, 4):
                for max_kv in (1, 255, 4096, 262144):
                    s = _C.make_attention_schedule(batch, q_len, heads, max_kv, sms, tag, limits)
                    what = f"{gpu} B={batch} H={heads} S_q={q_len} kv={max_kv}: {s.num_splits} x {s.tokens_per_split}"
                    assert s.tiles.block_m > 0, what
                    assert 1 <= s.num_splits <= _C.max_attention_splits, what
                    assert s.num_splits * s.tokens_per_split >= max_kv, what
                    assert (s.num_splits - 1) * s.tokens_per_split < max_kv, what
                    assert s.tokens_per_split % 64 == 0, what
                    if s.num_splits > 1:
                        ctas = batch * -(-q_len * heads // s.tiles.block_m)
                        assert ctas * s.num_splits <= s.tiles.ctas_per_sm * sms, what


def test_resolve_arch_takes_sm90_on_hopper_only():
    """The auto tag is the newest variant the build has for a GPU (Sm90 needs sm_90 code, compiled as
    sm_90a); a forced tag runs only where the build has code at or above it."""
    built = [int(a) for a in _C.compiled_cuda_archs().split(",")]
    tags = {70: _C.Arch.sm70, 75: _C.Arch.sm75, 80: _C.Arch.sm80, 90: _C.Arch.sm90}
    for cc in (70, 75, 80, 86, 89, 90):
        target = max([a for a in built if a <= cc], default=0)
        best = max([t for t in tags if t <= target], default=None)
        want_auto = tags[best] if target and best else _C.Arch.auto
        assert _C.resolve_arch(_C.Arch.auto, cc) == want_auto, f"auto on sm_{cc} (built {built})"
        for t, tag in tags.items():
            want = tag if target and t <= target else _C.Arch.auto
            assert _C.resolve_arch(tag, cc) == want, f"{tag} on sm_{cc} (built {built})"
    if 90 in built:
        assert _C.resolve_arch(_C.Arch.auto, 90) == _C.Arch.sm90
        assert _C.resolve_arch(_C.Arch.sm80, 90) == _C.Arch.sm80  # the mma.sync kernel stays testable


@pytest.mark.parametrize("tag,limits,dims,want_rows,want_bytes", [
    ("sm70", "V100", (256, 256), 64, 91_904), ("sm70", "V100", (192, 128), 64, 71_424),
    ("sm75", "T4 / RTX 20", (256, 256), 32, 62_848), ("sm75", "T4 / RTX 20", (192, 128), 64, 62_208),
    ("sm75", "T4 / RTX 20", (128, 128), 64, 59_136),
    ("sm70", "T4 / RTX 20", (256, 256), 32, 62_848),  # below its V100: the smallest-footprint height
    ("sm70", (30_000, 30_000), (256, 256), 0, 0), ("sm75", "V100", (256, 264), 0, 0), ("sm80", "V100", (256, 256), 0, 0)])
def test_expanded_attention_tiles_fit_each_gpu_class(tag, limits, dims, want_rows, want_bytes):
    """The expanded-form kernel's tile plan under a GPU class's limits (no GPU needed: the limits given
    are used as they are)."""
    spec = gpus.smem_limits(limits)
    tiles = _C.expanded_attention_tiles(getattr(_C.Arch, tag), *dims,
                                        _C.SmemLimits(spec.per_block, spec.per_sm, spec.reserved_per_block))
    assert (tiles.block_m, tiles.smem_bytes) == (want_rows, want_bytes)
    assert tiles.smem_bytes <= spec.per_block


def test_expanded_attention_refuses_what_it_has_no_kernel_for():
    assert _C.expanded_attention_supported(_C.Arch.sm70, 256, 256, _C.DType.float16)
    assert not _C.expanded_attention_supported(_C.Arch.sm75, 256, 256, _C.DType.bfloat16)
    assert not _C.expanded_attention_supported(_C.Arch.sm80, 192, 128, _C.DType.float16)
    p = _C.ExpandedAttentionParams()
    p.dtype = _C.DType.bfloat16
    with pytest.raises(RuntimeError, match="expanded_attention: dtype not supported"):
        _C.expanded_attention(p, _C.Arch.auto, 0)
    # Refused before the device is asked which variant it runs (no GPU here); an empty batch launches
    # nothing and succeeds.
    p.dtype, p.head_dim_qk, p.head_dim_v = _C.DType.float16, 256, 256
    p.batch, p.num_heads, p.max_q_len = 1, 1, 1
    p.cu_q_lens = p.cu_k_lens = p.out = p.k = p.v = 256  # q left null
    with pytest.raises(RuntimeError, match="expanded_attention: invalid argument"):
        _C.expanded_attention(p, _C.Arch.auto, 0)
    p.q, p.head_dim_v = 256, 128
    with pytest.raises(RuntimeError, match="expanded_attention: invalid argument"):  # (256, 128): no kernel
        _C.expanded_attention(p, _C.Arch.auto, 0)
    p.head_dim_v, p.batch = 256, 0
    _C.expanded_attention(p, _C.Arch.auto, 0)


def index_keys_params(num_tokens=0):
    p = _C.WriteIndexKeysParams()
    p.dtype, p.num_tokens = _C.DType.float16, num_tokens  # no token: nothing to launch
    p.max_position, p.rope_style, p.scale_format = 16, _C.RopeStyle.neox, _C.IndexScaleFormat.raw
    return p


def host_checks_pass(call):
    """call() got past the entry point's own checks: it returned, or stopped at the arch lookup (no GPU)."""
    try:
        call()
    except RuntimeError as e:
        assert "invalid argument" not in str(e), e


def test_indexer_entry_points_check_on_the_host():
    """Each indexer entry point refuses a bad size before any launch and takes a good one, on the host alone
    (a host-side check that ran device code would end the process here)."""
    good, bad = _C.IndexCache(0, 4, 64, 64 * 132), _C.IndexCache(0, 4, 0, 64 * 132)
    host_checks_pass(lambda: _C.write_index_keys_paged(index_keys_params(), good, 0, _C.Arch.auto, 0))
    with pytest.raises(RuntimeError, match="invalid argument"):
        _C.write_index_keys_paged(index_keys_params(), bad, 0, _C.Arch.auto, 0)

    scores = _C.IndexScoresParams()
    scores.heads, scores.max_q_len, scores.max_kv_len, scores.logits_stride = 32, 1, 64, 64
    host_checks_pass(lambda: _C.index_scores(scores, good, _C.Arch.auto, 0))
    scores.heads = 48
    with pytest.raises(RuntimeError, match="invalid argument"):
        _C.index_scores(scores, good, _C.Arch.auto, 0)

    topk = _C.IndexTopkParams()
    topk.k, topk.max_kv_len, topk.logits_stride, topk.indices_stride = 8, 64, 64, 8
    host_checks_pass(lambda: _C.index_topk(topk, 0, _C.Arch.auto, 0))
    topk.k = 0
    with pytest.raises(RuntimeError, match="invalid argument"):
        _C.index_topk(topk, 0, _C.Arch.auto, 0)
