"""The reference write ops and the layout helpers against cases built independently here.

Expected caches are built by explicit per-token loops; the expected rotation uses complex
multiplication (pair (a, b) -> (a + ib) * e^(i angle)) and a cos/sin table made here from theta,
not mla_kv.rope. Caches start poisoned with NaN so that every row not written is checked too.
"""
from __future__ import annotations

import pytest
import torch

from mla_kv import layout, reference

LATENT, ROPE, ROW = reference.LATENT_DIM, reference.ROPE_DIM, reference.ROW_DIM
HALF = ROPE // 2


def _poisoned_cache(num_blocks: int, block_size: int, dtype) -> torch.Tensor:
    return torch.full((num_blocks, block_size, ROW), float("nan"), dtype=dtype)


def _slots(tokens: int, capacity: int, padded: int) -> torch.Tensor:
    """Distinct random slots in shuffled order, ``padded`` of them -1."""
    slots = torch.randperm(capacity)[:tokens]
    slots[torch.randperm(tokens)[:padded]] = -1
    return slots


def _expected_cache(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` with rows[t] at slot slots[t] for every t with a non-negative slot."""
    expected = cache.clone()
    block_size = cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, slot % block_size] = rows[t]
    return expected


def _assert_cache_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal values where expected is written, NaN (still poisoned) everywhere else."""
    poisoned = expected.isnan()
    assert torch.equal(actual.isnan(), poisoned)
    assert torch.equal(actual[~poisoned], expected[~poisoned])


def _strided_rows(tokens: int, width: int, dtype, extra_rows: int = 3) -> torch.Tensor:
    """[tokens + extra_rows, width] as a column slice of a wider buffer (row stride > width); the
    extra rows are NaN so that reading past the token count would show up in the cache."""
    buffer = torch.randn(tokens + extra_rows, width + 40, dtype=torch.float64).to(dtype)
    buffer[tokens:] = float("nan")
    return buffer[:, 8:8 + width]


# ------------------------------------------------------------------------------- write_kv
def test_write_kv_literal_case():
    """Block size 2, three blocks; tokens 0 and 2 land in slots 5 and 0, token 1 is padding."""
    kv_c = torch.arange(1, 4, dtype=torch.float32)[:, None].expand(3, LATENT)
    k_pe = -torch.arange(1, 4, dtype=torch.float32)[:, None].expand(3, ROPE)
    cache = _poisoned_cache(3, 2, torch.float32)
    reference.write_kv(kv_c, k_pe, cache, torch.tensor([5, -1, 0]))
    assert (cache[2, 1, :LATENT] == 1).all() and (cache[2, 1, LATENT:] == -1).all()
    assert (cache[0, 0, :LATENT] == 3).all() and (cache[0, 0, LATENT:] == -3).all()
    written = torch.zeros(3, 2, dtype=torch.bool)
    written[2, 1] = written[0, 0] = True
    assert cache[~written].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 64])
def test_write_kv_matches_per_token_loop(dtype, block_size):
    tokens, num_blocks = 37, 6
    kv_c, k_pe = _strided_rows(tokens, LATENT, dtype), _strided_rows(tokens, ROPE, dtype)
    slots = _slots(tokens, num_blocks * block_size, padded=5)
    cache = _poisoned_cache(num_blocks, block_size, dtype)
    rows = [torch.cat([kv_c[t], k_pe[t]]) for t in range(tokens)]
    expected = _expected_cache(cache, rows, slots)
    reference.write_kv(kv_c, k_pe, cache, slots)
    _assert_cache_equal(cache, expected)


def test_write_kv_all_padded_writes_nothing():
    cache = _poisoned_cache(2, 16, torch.float16)
    reference.write_kv(torch.randn(4, LATENT).half(), torch.randn(4, ROPE).half(), cache,
                       torch.full((4,), -1, dtype=torch.int64))
    assert cache.isnan().all()


# ------------------------------------------------------------------------------- fused_write_kv
def _table(theta: float, max_position: int, magnitude: float) -> torch.Tensor:
    """[max_position, 64] = magnitude * [cos(p * theta^(-2i/64)) | sin(...)], float64."""
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * theta ** (
        -torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    return magnitude * torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [64] float64 with pair i turned by cos[i] + i sin[i]: pairs (2i, 2i+1) interleaved, (i, i+32) neox."""
    turn = torch.complex(cos, sin)
    if style == "interleaved":
        return torch.view_as_real(torch.view_as_complex(x.reshape(HALF, 2).contiguous()) * turn).reshape(ROPE)
    z = torch.complex(x[:HALF], x[HALF:]) * turn
    return torch.cat([z.real, z.imag])


def _rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / (x.pow(2).mean() + eps).sqrt()


@pytest.mark.parametrize("style", ["interleaved", "neox"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1.0, 1.25])  # 1.25: a YaRN-style mscale folded into the table
def test_fused_write_kv_matches_per_token_loop(style, dtype, magnitude, ulp_distance):
    tokens, heads, qk_nope, num_blocks, block_size, max_position = 29, 3, 192, 5, 16, 4096
    eps = 1e-6
    kv_a = _strided_rows(tokens, ROW, dtype)
    weight = (1 + 0.2 * torch.randn(LATENT, dtype=torch.float64)).to(dtype)
    positions = torch.randint(0, max_position, (tokens + 2,))
    table = _table(1e4, max_position, magnitude).to(dtype)
    slots = _slots(tokens, num_blocks * block_size, padded=4)
    # q [T, H, 256] with heads outermost in memory, so neither its token nor its head dim is packed
    q = torch.randn(heads, tokens, qk_nope + ROPE, dtype=torch.float64).to(dtype).transpose(0, 1)
    q_before = q.clone()
    cache = _poisoned_cache(num_blocks, block_size, dtype)

    rows, q_rope = [], torch.empty(tokens, heads, ROPE, dtype=torch.float64)
    for t in range(tokens):
        cos, sin = table[positions[t], :HALF].double(), table[positions[t], HALF:].double()
        row = kv_a[t].double()
        rows.append(torch.cat([_rms_normed(row[:LATENT], weight.double(), eps),
                               _rotated(row[LATENT:], cos, sin, style)]))
        for h in range(heads):
            q_rope[t, h] = _rotated(q_before[t, h, qk_nope:].double(), cos, sin, style)
    expected = _expected_cache(cache.double(), rows, slots)

    reference.fused_write_kv(kv_a, weight, eps, positions, table, cache, slots, rope_style=style, q=q)

    assert torch.equal(cache.isnan(), expected.isnan())
    assert torch.equal(q[..., :qk_nope], q_before[..., :qk_nope])  # only the rope part of q changes
    written = ~expected.isnan().all(-1)
    pairs = [(cache[written][:, :LATENT], expected[written][:, :LATENT]),
             (cache[written][:, LATENT:], expected[written][:, LATENT:]), (q[..., qk_nope:], q_rope)]
    if dtype == torch.float64:
        for actual, wanted in pairs:
            torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12)
    elif dtype == torch.float32:
        for actual, wanted in pairs:
            torch.testing.assert_close(actual, wanted.float())
    else:
        # float32 math rounded once to the dtype: at most one step from the correctly rounded result
        # (half-precision products are exact in float32, so even a cancelling rotation stays within it)
        for actual, wanted in pairs:
            assert ulp_distance(actual, wanted.to(dtype)).max() <= 1


def test_fused_write_kv_rotates_padded_tokens_of_q():
    """A token with slot -1 writes no cache row but its q is still rotated; position 0 is identity."""
    table = _table(1e4, 64, 1.0)
    kv_a = torch.randn(2, ROW, dtype=torch.float64)
    q = torch.randn(2, 1, 128 + ROPE, dtype=torch.float64)
    q_before = q.clone()
    cache = _poisoned_cache(1, 16, torch.float64)
    reference.fused_write_kv(kv_a, torch.ones(LATENT, dtype=torch.float64), 1e-6, torch.tensor([0, 5]),
                             table, cache, torch.tensor([3, -1]), q=q)
    assert torch.equal(q[0], q_before[0])
    angle = 5 * 1e4 ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    torch.testing.assert_close(q[1, 0, 128:], _rotated(q_before[1, 0, 128:], angle.cos(), angle.sin(), "interleaved"),
                               rtol=1e-12, atol=1e-12)
    assert cache[0, [i for i in range(16) if i != 3]].isnan().all()
    torch.testing.assert_close(cache[0, 3, LATENT:], kv_a[0, LATENT:], rtol=0, atol=0)


# ------------------------------------------------------------------------------- layout
def test_block_slots_two_sequences_shuffled_blocks():
    """block_seq_len 4. Sequence 0: history 3, 4 new tokens, blocks [5, 2] -> positions 3..6.
    Sequence 1: history 0, 2 new, block [7]. Sequence 2: history 2, 3 new, one block [0]: its
    third new token (position 4) has no block and maps to -1."""
    slots = layout.block_slots(cu_q_lens=torch.tensor([0, 4, 6, 9]), history_lens=torch.tensor([3, 0, 2]),
                               cu_block_nums=torch.tensor([0, 2, 3, 4]), block_ids=torch.tensor([5, 2, 7, 0]),
                               block_seq_len=4)
    assert slots.tolist() == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 7 * 4 + 0, 7 * 4 + 1, 2, 3, -1]


def test_block_slots_skip_readonly_rows_and_other_ranks():
    """block_seq_len 4, blocks [5, 2] then [7, 1]. Sequence 0: history 3, 4 new tokens (positions 3..6),
    read-only rows 0..4: positions 3 and 4 are skipped. Sequence 1 under cp 2, rank 1: positions 1..6
    (history 1), odd ones are this rank's, at local rows 0, 1, 2; read-only local row 0 is skipped."""
    slots = layout.block_slots(cu_q_lens=torch.tensor([0, 4]), history_lens=torch.tensor([3]),
                               cu_block_nums=torch.tensor([0, 2]), block_ids=torch.tensor([5, 2]), block_seq_len=4,
                               readonly_lens=torch.tensor([5]))
    assert slots.tolist() == [-1, -1, 2 * 4 + 1, 2 * 4 + 2]
    slots = layout.block_slots(cu_q_lens=torch.tensor([0, 6]), history_lens=torch.tensor([1]),
                               cu_block_nums=torch.tensor([0, 2]), block_ids=torch.tensor([7, 1]), block_seq_len=4,
                               readonly_lens=torch.tensor([1]), cp_size=2, cp_rank=1)
    assert slots.tolist() == [-1, -1, 7 * 4 + 1, -1, 7 * 4 + 2, -1]


def test_block_table_slots_hand_checked():
    table = torch.tensor([[3, 0, 9], [1, 4, 4]], dtype=torch.int32)
    slots = layout.block_table_slots(table, torch.tensor([5, 2]), block_size=2)
    assert [s.tolist() for s in slots] == [[6, 7, 0, 1, 18], [2, 3]]


@pytest.mark.parametrize("rope_first", [True, False])
def test_block_pool_addresses_match_layer_views(rope_first):
    pool = layout.BlockPool(num_blocks=6, num_layers=3, block_seq_len=8, dtype=torch.float16,
                            rope_first=rope_first)
    block_ids, cu_block_nums = torch.tensor([4, 1, 5, 0]), torch.tensor([0, 3, 4])
    row_bytes = ROW * 2
    for layer in range(3):
        view = pool.layer_view(layer)
        cache = pool.cache(layer, block_ids, cu_block_nums)
        assert cache.batch == 2 and cache.dtype == torch.float16 and cache.row_stride_bytes == row_bytes
        assert cache.block_seq_len == 8 and cache.rope_first == rope_first
        assert cache.cu_block_nums.dtype == torch.int32 and cache.cu_block_nums.tolist() == [0, 3, 4]
        assert (cache.rope_offset, cache.latent_offset) == ((0, ROPE) if rope_first else (LATENT, 0))
        for i, block in enumerate(block_ids.tolist()):
            for r in (0, 5, 7):
                address = int(cache.block_ptrs[i]) + cache.layer_offset_bytes + r * cache.row_stride_bytes
                assert view[block, r].data_ptr() == address


def test_row_order_conversions():
    rows = torch.randn(3, 5, ROW)
    rope_first = layout.to_rope_first(rows)
    assert torch.equal(rope_first[..., :ROPE], rows[..., LATENT:])
    assert torch.equal(rope_first[..., ROPE:], rows[..., :LATENT])
    assert torch.equal(layout.to_latent_first(rope_first), rows)
