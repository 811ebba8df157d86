"""Host-side checks of the C++ entry points, called through the bindings (no GPU needed: they
return before anything touches the device)."""
import pytest

from mla_kv import ops

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
