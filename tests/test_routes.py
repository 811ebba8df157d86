"""The prefill route chooser (mla_kv.routes): the FLOP rule's crossovers, the measured table kept in the
package, interpolation between its points and the table's production by ``mla-kv bench prefill --routes``
(its measurements faked). CPU only."""
import json
import math

import pytest

from mla_kv import routes
from mla_kv.bench import common, prefill as bench_prefill


def test_flop_rule_crossovers_over_a_long_prefix():
    """Expanding a chunk over a long prefix pays from ~171 queries at DeepSeek dims and ~398 at GLM's
    (issue 22's estimate; the prefix's up-projection against the absorbed kernel's extra work)."""
    for (d_nope, d_v), crossover in (((128, 128), 171), ((192, 256), 398)):
        assert routes.flop_rule(crossover - 2, 1 << 20, d_nope, d_v) == "absorbed"
        assert routes.flop_rule(crossover + 2, 1 << 20, d_nope, d_v) == "expanded"
    for q_len in (1, 64, 8192):
        assert routes.flop_rule(q_len, 0, 128, 128) == "expanded"  # a whole prompt: nothing to up-project twice


def test_package_table_is_complete():
    table = routes.measured_table()
    assert set(table["tags"]) <= {"sm70", "sm75", "sm80", "sm90"} and table["tags"]
    for tag, by_dims in table["tags"].items():
        assert "mla-kv bench prefill --routes" in table["measured"][tag]
        for dims, by_heads in by_dims.items():
            d_nope, d_v = map(int, dims.split("/"))
            assert d_nope > 0 and d_v > 0 and by_heads
            for heads, grid in by_heads.items():
                assert int(heads) > 0
                q_lens, prefixes, z = grid["q_lens"], grid["prefixes"], grid["log_ratio"]
                assert q_lens == sorted(set(q_lens)) and prefixes == sorted(set(prefixes))
                assert len(z) == len(q_lens) and all(len(row) == len(prefixes) for row in z)
                assert all(math.isfinite(v) for row in z for v in row)


def test_choice_at_every_measured_point_is_the_measured_winner():
    table = routes.measured_table()
    for tag, by_dims in table["tags"].items():
        for dims, by_heads in by_dims.items():
            d_nope, d_v = map(int, dims.split("/"))
            for heads, grid in by_heads.items():
                for i, q_len in enumerate(grid["q_lens"]):
                    for j, prefix in enumerate(grid["prefixes"]):
                        want = "expanded" if grid["log_ratio"][i][j] < 0 else "absorbed"
                        got = routes.choose_prefill_route(q_len, q_len + prefix, int(heads), d_nope, d_v, arch=tag)
                        assert got == want, (tag, dims, heads, q_len, prefix)


SYNTHETIC = {"tags": {"sm80": {"128/128": {
    "16": {"q_lens": [128, 2048], "prefixes": [0, 4095], "log_ratio": [[-1.0, 1.0], [-3.0, -1.0]]},
    "128": {"q_lens": [128], "prefixes": [0], "log_ratio": [[2.0]]}}}}, "measured": {}}


def test_interpolation_between_points_and_clamping_outside():
    choose = lambda q, prefix, heads=16: routes.choose_prefill_route(q, q + prefix, heads, 128, 128, arch="sm80",
                                                                     table=SYNTHETIC)
    # q 128: -1 at prefix 0, +1 at 4095; halfway in ln(prefix + 1) (prefix 63) the ratio is 1: the sign
    # turns there.
    assert choose(128, 40) == "expanded" and choose(128, 100) == "absorbed"
    assert choose(128, 1 << 20) == "absorbed"  # clamped to the last prefix
    assert choose(2048, 4095) == "expanded" and choose(1 << 16, 4095) == "expanded"  # clamped to q 2048
    mid_q = int(math.exp((math.log(128) + math.log(2048)) / 2))  # (+1 + -1) / 2 = 0 at prefix 4095: not < 0
    assert choose(mid_q - 8, 4095) == "absorbed" and choose(mid_q + 8, 4095) == "expanded"
    # The nearest measured head count: 100 heads -> the 128-head grid (a single point, +2).
    assert choose(128, 0, heads=100) == "absorbed" and choose(128, 0, heads=20) == "expanded"


def test_without_measurements_the_flop_rule_decides():
    for tag, dims in (("sm70", (128, 128)), ("sm80", (192, 256))):
        for q_len, prefix in ((100, 60000), (500, 60000), (64, 0)):
            got = routes.choose_prefill_route(q_len, q_len + prefix, 16, *dims, arch=tag, table=SYNTHETIC)
            assert got == routes.flop_rule(q_len, prefix, *dims)


@pytest.mark.parametrize("kwargs,match", [
    (dict(q_len=0), "q_len"), (dict(kv_len=5), "kv_len: must include"), (dict(num_heads=0), "num_heads"),
    (dict(d_v=0), "d_v"), (dict(q_len=1.5), "q_len")])
def test_bad_arguments_name_themselves(kwargs, match):
    args = dict(q_len=10, kv_len=100, num_heads=16, d_nope=128, d_v=128) | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        routes.choose_prefill_route(**args, arch="sm80")


def _row(tag, heads, q_len, prefix, ratio):
    return {"tag": tag, "d_nope": 128, "d_v": 128, "H": heads, "q_len": q_len, "prefix": prefix, "absorbed_ms": 1.0,
            "expanded_ms": ratio}


def test_grid_from_rows_needs_a_full_grid():
    rows = [_row("sm80", 16, q, p, 0.5) for q in (128, 512) for p in (0, 2048)]
    grid = routes.grid_from_rows(rows)["128/128"]["16"]
    assert grid["q_lens"] == [128, 512] and grid["prefixes"] == [0, 2048]
    assert grid["log_ratio"] == [[round(math.log(0.5), 4)] * 2] * 2
    with pytest.raises(ValueError, match="rows: the 128/128 H=16 grid lacks"):
        routes.grid_from_rows(rows[:-1])


def _fake_gpu(monkeypatch, capability):
    """What the bench's main asks of the GPU, answered on the CPU (its measurements are faked apart)."""
    monkeypatch.setattr(common, "kernels_present", lambda name: True)
    monkeypatch.setattr(common, "device_info", lambda: {"gpu": "Fake GPU"})
    cpu_generator = bench_prefill.torch.Generator
    monkeypatch.setattr(bench_prefill.torch, "Generator", lambda device=None: cpu_generator())
    monkeypatch.setattr(bench_prefill.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench_prefill.torch.cuda, "get_device_capability", lambda device=None: capability)


def test_bench_routes_merges_its_grid_into_the_table(monkeypatch, tmp_path, capsys):
    table = tmp_path / "routes.json"
    table.write_text(json.dumps({"tags": {"sm90": {"x": 1}}, "measured": {"sm90": "before"}}))
    monkeypatch.setattr(bench_prefill, "ROUTE_GRIDS", {"native": ((128, 512), (0, 2048), (16,)),
                                                       "emulated": ((128,), (0,), (16,))})
    monkeypatch.setattr(bench_prefill, "route_case", lambda q, p, h, dtype, arch, gen: dict(
        _row(arch, h, q, p, 0.5 if q == 512 else 2.0), model="m", B=1, winner="-", **{
            "expanded/absorbed": 1.0, "flop rule": "-", "rel_diff": 0.0}))
    _fake_gpu(monkeypatch, (8, 0))
    assert bench_prefill.main(["--routes", "--arch", "sm80", "--table", str(table)]) == 0
    merged = json.loads(table.read_text())
    assert merged["tags"]["sm90"] == {"x": 1} and merged["measured"]["sm90"] == "before"
    assert "Fake GPU" in merged["measured"]["sm80"]
    assert routes.choose_prefill_route(512, 512, 16, 128, 128, arch="sm80", table=merged) == "expanded"
    assert routes.choose_prefill_route(128, 2176, 16, 128, 128, arch="sm80", table=merged) == "absorbed"
    assert "wrote the sm80 grid" in capsys.readouterr().out


def test_bench_routes_check_reports_the_picks_loss(monkeypatch, capsys):
    """--routes --check: each point's pick (the chooser over the package table) and how much slower than
    the faster route it is."""
    monkeypatch.setattr(bench_prefill, "ROUTE_GRIDS", {"check": ((256, 4096), (1024,), (16,))})
    times = {256: (1.0, 1.5), 4096: (4.0, 2.0)}  # (absorbed, expanded) ms

    def fake_case(q, p, h, dtype, arch, gen):
        t_abs, t_exp = times[q]
        return dict(_row(arch, h, q, p, t_exp), absorbed_ms=t_abs, model="m", B=1, **{
            "winner": "absorbed" if t_abs <= t_exp else "expanded", "flop rule": "-"})
    monkeypatch.setattr(bench_prefill, "route_case", fake_case)
    monkeypatch.setattr(bench_prefill.routes, "choose_prefill_route", lambda *a, **k: "expanded")
    _fake_gpu(monkeypatch, (9, 0))
    assert bench_prefill.main(["--routes", "--check", "--arch", "sm90"]) == 0
    out = capsys.readouterr().out
    assert "the faster route in 1 of 2 points; worst 50.0% slower (H=16 q=256 prefix=1024); within 5% at 1" in out
