"""The reference's skip rules, which the kernels' guards match without validation (GPU side:
tests/test_write.py, tests/test_attention_guards.py, tests/test_gather.py): what a write leaves
unwritten and which block-table entries the reads never look at. Caches start NaN, so a row written
by mistake shows; expected rows are built here token by token.
"""
import pytest
import torch

from mla_kv import layout, reference
from mla_kv.rope import cos_sin_cache

ROW = reference.ROW_DIM


def nan_cache(num_blocks, block_size):
    return torch.full((num_blocks, block_size, ROW), float("nan"), dtype=torch.float64)


def test_write_kv_skips_negative_slots_and_slots_past_the_capacity():
    """Capacity 3 blocks x 4 = 12: only the tokens with slots 5 and 11 are written."""
    slots = torch.tensor([5, -1, -7, 12, 40, -2 ** 62, 2 ** 40, 11])
    rows = torch.arange(len(slots), dtype=torch.float64)[:, None].expand(-1, ROW) + 1
    cache = nan_cache(3, 4)
    reference.write_kv(rows[:, :512], rows[:, 512:], cache, slots)
    flat = cache.view(-1, ROW)
    assert torch.equal(flat[5], rows[0]) and torch.equal(flat[11], rows[7])
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[[5, 11]] = False
    assert flat[untouched].isnan().all()


def test_fused_write_kv_skips_tokens_outside_the_rope_table():
    """A token whose position is outside [0, max_position) writes no row and leaves its q alone; a
    padded slot (-1) with a good position writes no row but rotates its q; max_position - 1 is good."""
    max_position = 16
    positions = torch.tensor([-1, max_position, 2 ** 40, max_position - 1, 3, 7])
    slots = torch.tensor([0, 1, 2, 3, 4, -1])
    kv_a = torch.randn(6, ROW, dtype=torch.float64)
    q = torch.randn(6, 2, 128 + 64, dtype=torch.float64)
    q_before = q.clone()
    cs = cos_sin_cache(64, max_position, 1e4, dtype=torch.float64)
    cache = nan_cache(2, 4)
    reference.fused_write_kv(kv_a, torch.ones(512, dtype=torch.float64), 1e-6, positions, cs, cache, slots, q=q)
    flat = cache.view(-1, ROW)
    assert flat[[0, 1, 2, 5, 6, 7]].isnan().all(), "a token outside the rope table wrote its row"
    assert not flat[[3, 4]].isnan().any()
    assert torch.equal(q[:3], q_before[:3]), "q of a token outside the rope table was rotated"
    for t in (3, 4, 5):
        want = reference.apply_rope(q_before[t:t + 1, :, 128:], positions[t:t + 1], cs)
        assert torch.equal(q[t:t + 1, :, 128:], want) and not torch.equal(want, q_before[t:t + 1, :, 128:])


def test_block_slots_give_negative_positions_no_slot():
    """Sequence 1's history is -2: its first two tokens (positions -2, -1) have no row."""
    slots = layout.block_slots(cu_q_lens=torch.tensor([0, 2, 5]), history_lens=torch.tensor([0, -2]),
                               cu_block_nums=torch.tensor([0, 1, 2]), block_ids=torch.tensor([9, 5]),
                               block_seq_len=4)
    assert slots.tolist() == [9 * 4, 9 * 4 + 1, -1, -1, 5 * 4]


def test_reads_never_look_at_table_entries_past_a_sequence():
    """decode, prefill and gather_kv give the same result whatever the block table holds past the
    blocks each sequence's positions need (ids -1, past the cache, 2^31 - 1)."""
    lens = [5, 9, 0]
    cache = torch.randn(6, 4, ROW, dtype=torch.float64)
    clean = torch.tensor([[0, 1, 2], [3, 4, 5], [1, 2, 3]], dtype=torch.int32)
    garbage = torch.tensor([[0, 1, -1], [3, 4, 5], [2 ** 31 - 1, 6, -1]], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, 2, 4, ROW, dtype=torch.float64)
    for a, b in zip(reference.decode(q, cache, clean, seq_lens, 0.1),
                    reference.decode(q, cache, garbage, seq_lens, 0.1)):
        assert torch.equal(a, b)
    cu = torch.tensor([0, 2, 4, 4], dtype=torch.int32)
    qp = torch.randn(4, 4, ROW, dtype=torch.float64)
    for a, b in zip(reference.prefill(qp, cache, clean, cu, seq_lens, 0.1),
                    reference.prefill(qp, cache, garbage, cu, seq_lens, 0.1)):
        assert torch.equal(a, b)
    cu_kv = torch.tensor([0, 5, 14, 14], dtype=torch.int32)
    assert torch.equal(reference.gather_kv(cache, clean, cu_kv), reference.gather_kv(cache, garbage, cu_kv))
