"""Context-parallel scenarios shared by tests/test_parallel.py, and its gloo worker process.

A scenario is a batch of sequences with a cached prefix (history) and new tokens. The single-process
truth writes everything into one cache with the ordinary ops and runs the float64 reference; a cp
rank builds its own cache with shuffled blocks through mla_kv.parallel and returns its partial
(out, lse). The data comes from a generator seeded by the caller, so every process builds the same
batch. Caches start as NaN: a token a rank should have written but did not poisons the result.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist

import mla_kv
from mla_kv import parallel, reference, rope

HEADS = 4
BLOCK_SIZE = 4
MAX_POSITION = 256
SCALE = rope.mla_softmax_scale(192, 64)
DTYPE = torch.float32  # mla_kv.merge_states takes fp16/bf16/fp32 states
TOL = dict(rtol=2e-5, atol=2e-5)


@dataclass
class Batch:
    prefix_lens: List[int]
    new_lens: List[int]
    kv_a_prefix: torch.Tensor  # [sum(prefix_lens), 576] raw kv_a rows
    kv_a_new: torch.Tensor     # [sum(new_lens), 576]
    q_new: torch.Tensor        # [sum(new_lens), H, 576] = [q_lat | q_pe] before RoPE
    rms_weight: torch.Tensor
    cos_sin: torch.Tensor


def make_batch(seed: int, prefix_lens: List[int], new_lens: List[int]) -> Batch:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DTYPE)

    return Batch(prefix_lens, new_lens, randn(sum(prefix_lens), 576), randn(sum(new_lens), 576),
                 randn(sum(new_lens), HEADS, 576), 1 + 0.1 * randn(512),
                 rope.cos_sin_cache(64, MAX_POSITION, theta=1e4, dtype=DTYPE))


def cu_lens(lens: List[int]) -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def total_lens(batch: Batch) -> torch.Tensor:
    return torch.tensor([p + n for p, n in zip(batch.prefix_lens, batch.new_lens)], dtype=torch.int32)


def write_global(batch: Batch):
    """One cache with every token, written by the ordinary fused_write_kv -> (cache, table, rotated q)."""
    width = max(1, -(-max(total_lens(batch).tolist()) // BLOCK_SIZE))
    table = torch.arange(len(batch.new_lens) * width, dtype=torch.int32).view(-1, width)
    cache = torch.full((table.numel(), BLOCK_SIZE, 576), float("nan"), dtype=DTYPE)
    q = batch.q_new.clone()
    for kv_a, starts, lens, q_arg in ((batch.kv_a_prefix, [0] * len(batch.prefix_lens), batch.prefix_lens, None),
                                      (batch.kv_a_new, batch.prefix_lens, batch.new_lens, q)):
        positions = [s + i for s, n in zip(starts, lens) for i in range(n)]
        slots = [b * width * BLOCK_SIZE + p for b, (s, n) in enumerate(zip(starts, lens)) for p in range(s, s + n)]
        mla_kv.fused_write_kv(kv_a, batch.rms_weight, 1e-6, torch.tensor(positions, dtype=torch.int64),
                              batch.cos_sin, cache, torch.tensor(slots, dtype=torch.int64), q=q_arg)
    return cache, table, q


def write_rank(batch: Batch, cp: int, rank: int, seed: int):
    """Rank ``rank``'s cache (its tokens only, in shuffled blocks) through cp_fused_write_kv.

    Returns (cache, local block table, q rotated by this rank's write).
    """
    local = [len(range(rank, n, cp)) for n in total_lens(batch).tolist()]  # positions t < n, t % cp == rank
    need = [-(-n // BLOCK_SIZE) for n in local]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 1000 * rank)).int()
    table = torch.full((len(local), max(need) + 1), num_blocks + 5, dtype=torch.int32)  # poison past the end
    taken = 0
    for b, n in enumerate(need):
        table[b, :n] = order[taken:taken + n]
        taken += n
    cache = torch.full((num_blocks, BLOCK_SIZE, 576), float("nan"), dtype=DTYPE)
    q = batch.q_new.clone()
    zeros = torch.zeros(len(local), dtype=torch.int32)
    parallel.cp_fused_write_kv(batch.kv_a_prefix, batch.rms_weight, 1e-6, batch.cos_sin, cache, table,
                               cu_lens(batch.prefix_lens), zeros, cp, rank)
    parallel.cp_fused_write_kv(batch.kv_a_new, batch.rms_weight, 1e-6, batch.cos_sin, cache, table,
                               cu_lens(batch.new_lens), torch.tensor(batch.prefix_lens, dtype=torch.int32),
                               cp, rank, q=q)
    return cache, table, q


def rank_decode(batch: Batch, cp: int, rank: int, seed: int):
    """This rank's partial decode (uniform new_lens = S_q) -> (out, lse, rotated q)."""
    cache, table, q = write_rank(batch, cp, rank, seed)
    q4 = q.view(len(batch.new_lens), batch.new_lens[0], HEADS, 576)
    out, lse = parallel.cp_decode(q4, cache, table, total_lens(batch), SCALE, cp, rank)
    return out, lse, q


def rank_prefill(batch: Batch, cp: int, rank: int, seed: int, causal: bool):
    cache, table, q = write_rank(batch, cp, rank, seed)
    out, lse = parallel.cp_prefill(q, cache, table, cu_lens(batch.new_lens), total_lens(batch), SCALE, cp, rank,
                                   causal=causal)
    return out, lse, q


def truth_decode(batch: Batch):
    cache, table, q = write_global(batch)
    q4 = q.view(len(batch.new_lens), batch.new_lens[0], HEADS, 576)
    out, lse = reference.decode(q4.double(), cache.double(), table, total_lens(batch), SCALE)
    return out, lse, q


def truth_prefill(batch: Batch, causal: bool):
    cache, table, q = write_global(batch)
    out, lse = reference.prefill(q.double(), cache.double(), table, cu_lens(batch.new_lens), total_lens(batch),
                                 SCALE, causal=causal)
    return out, lse, q


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # Plain arithmetic: torch.testing's first call imports more than a whole case costs here.
    err = (got.double() - want).abs() - TOL["rtol"] * want.abs()
    assert bool((err <= TOL["atol"]).all()), f"{what}: off by up to {err.max().item():.2e} beyond the tolerance"


def check_merged(out, lse, truth_out, truth_lse, what: str) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in the merged out (a token was not written or not seen)"
    seen = torch.isfinite(truth_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{what}: the -inf pattern of lse differs"
    _assert_close(out, truth_out, f"{what}: out")
    _assert_close(lse[seen], truth_lse[seen], f"{what}: lse")


def scenarios(seed: int):
    """(name, batch, kind) cases every process runs: decode with S_q 1..3, prefill causal and not."""
    gen = torch.Generator().manual_seed(seed)

    def lens(n, lo, hi):
        return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()

    cases = []
    for s_q in (1, 2, 3):
        # One sequence with no history: its first queries see nothing on most ranks.
        prefix = [0] + lens(3, 1, 40)
        cases.append((f"decode S_q={s_q}", make_batch(seed + s_q, prefix, [s_q] * 4), "decode"))
    prefix, prompt = [0] + lens(2, 1, 24), [1] + lens(2, 2, 13)
    cases.append(("prefill causal", make_batch(seed + 7, prefix, prompt), "causal"))
    cases.append(("prefill full", make_batch(seed + 8, prefix, prompt), "full"))
    return cases


def rank_case(batch: Batch, kind: str, cp: int, rank: int, seed: int):
    """This rank's partial (out, lse, rotated q) of one case."""
    if kind == "decode":
        return rank_decode(batch, cp, rank, seed)
    return rank_prefill(batch, cp, rank, seed, causal=kind == "causal")


def truth_case(batch: Batch, kind: str):
    """The single-process (out, lse, rotated q) of one case."""
    if kind == "decode":
        return truth_decode(batch)
    return truth_prefill(batch, causal=kind == "causal")


def worker(rank: int, world: int, port: int, seed: int, package_file: str) -> None:
    """One gloo process (torch.multiprocessing.spawn): cp over the world, and cp 2 subgroups when world is 4."""
    assert mla_kv.__file__ == package_file, f"rank {rank} imported mla_kv from {mla_kv.__file__}"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        groups = [(None, world)]
        if world == 4:
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
            groups.append((pairs[rank // 2], 2))
        for group, cp in groups:
            cp_rank = dist.get_rank(group)
            for name, batch, kind in scenarios(seed):
                out, lse, q = rank_case(batch, kind, cp, cp_rank, seed)
                truth_out, truth_lse, truth_q = truth_case(batch, kind)
                what = f"rank {rank}, cp {cp}, {name}"
                assert torch.equal(q, truth_q), f"{what}: q rotated differently from the single-process write"
                merged_out, merged_lse = parallel.cp_merge(out, lse, group)
                check_merged(merged_out, merged_lse, truth_out, truth_lse, what)
    finally:
        dist.destroy_process_group()
