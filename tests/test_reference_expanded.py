"""The expanded-route prefill's spec equals the absorbed route (absorb q by W_UK, absorbed prefill,
project out by W_UV) in float64, at DeepSeek's and GLM-4.7-Flash's head dims, over cached prefixes."""
import pytest
import torch

from mla_kv import reference
from mla_kv.weights import absorb_q, project_out


@pytest.mark.parametrize("d_nope,d_v", [(128, 128), (192, 256)])
@pytest.mark.parametrize("causal", [True, False])
def test_expanded_equals_absorbed(d_nope, d_v, causal):
    gen = torch.Generator().manual_seed(d_nope + d_v + causal)
    heads, block_size = 5, 16
    kv_lens, q_lens = [40, 7, 0, 33], [40, 3, 0, 1]       # a whole prompt, extends, empty, one token
    num_blocks = sum(-(-n // block_size) for n in kv_lens) + 2
    cache = torch.randn(num_blocks, block_size, 576, generator=gen, dtype=torch.float64)
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = torch.full((4, 3), num_blocks + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(kv_lens):
        need = -(-n // block_size)
        table[b, :need] = perm[used:used + need]
        used += need
    cu = torch.tensor([0] + q_lens).cumsum(0).int()
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    q = torch.randn(int(cu[-1]) + 2, heads, d_nope + 64, generator=gen, dtype=torch.float64)  # 2 padded rows
    w_uk = torch.randn(heads, d_nope, 512, generator=gen, dtype=torch.float64) / 20
    w_uv = torch.randn(heads, d_v, 512, generator=gen, dtype=torch.float64) / 20
    scale = 1 / (d_nope + 64) ** 0.5

    out, lse = reference.prefill_expanded(q, cache, table, cu, lens, w_uk, w_uv, scale, causal=causal)
    q_abs = torch.cat([absorb_q(q[..., :d_nope], w_uk), q[..., d_nope:]], -1)
    o_lat, lse_abs = reference.prefill(q_abs, cache, table, cu, lens, scale, causal=causal)
    want = project_out(o_lat, w_uv)
    assert out.shape == want.shape == (q.shape[0], heads, d_v)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_abs, rtol=1e-12, atol=1e-12)
    assert bool((out[-2:] == 0).all()) and bool((lse[-2:] == float("-inf")).all())


def test_expanded_checks_its_weights():
    q = torch.zeros(2, 4, 192)
    cache = torch.zeros(2, 16, 576)
    table = torch.zeros(1, 1, dtype=torch.int32)
    cu, lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    w = torch.zeros(4, 128, 512)
    with pytest.raises(ValueError, match="w_uk"):
        reference.prefill_expanded(q, cache, table, cu, lens, torch.zeros(3, 128, 512), w, 0.1)
    with pytest.raises(ValueError, match="q: the last dim"):
        reference.prefill_expanded(q[..., :100], cache, table, cu, lens, w, w, 0.1)
    with pytest.raises(ValueError, match="w_uv"):
        reference.prefill_expanded(q, cache, table, cu, lens, w, torch.zeros(4, 128, 511), 0.1)
