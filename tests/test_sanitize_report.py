"""scripts/sanitize_calls.py's readers, on CPU: the allow-list parser and the compute-sanitizer log
parser (samples in the tool's format: compute-sanitizer 2023+ locations 'FUNC+0xOFF in FILE:LINE',
older 'at 0xOFF in FILE:LINE:FUNC'), the matching of reports to entries, and the table's verdict."""
import json
import re
from pathlib import Path

import pytest

import sanitize_calls as sanitize


WGMMA = ("void mla_kv::attention_detail::sm90::attention_wgmma_kernel<__half, mla_kv::PagedTableRows, (bool)1>"
         "(mla_kv::AttentionParams, T2, CUtensorMap_st)")
SM80 = ("void mla_kv::attention_detail::attention_kernel<mla_kv::arch::Sm80, __half, (int)16, "
        "mla_kv::PagedTableRows>(mla_kv::AttentionParams, T4)")
STORE = "mla_kv::arch::store<__half, (int)2>(__half *, const mla_kv::arch::Vec<__half, (int)2> &)"
DECODE = "decode/paged/best/float16/s1-h8"
WRITE = "write_kv/best/float16"

MEMCHECK_LOG = f"""\
========= COMPUTE-SANITIZER
mla_kv-sanitize: begin {WRITE}
mla_kv-sanitize: end {WRITE} ok
mla_kv-sanitize: begin {DECODE}
========= Invalid __global__ write of size 4 bytes
=========     at {STORE}+0x1a0 in arch.cuh:88
=========     by thread (3,0,0) in block (0,1,0)
=========     Access at 0x7f0000001000 is out of bounds
=========     and is 4 bytes after the nearest allocation at 0x7f0000000000 of size 4096 bytes
=========     Device Frame:{SM80}+0x90 in attention.cuh:427
=========
mla_kv-sanitize: end {DECODE} FAIL decode: row (0, 0, 1) relative error 1.00e+00 > 3e-03
========= Target application returned an error
========= ERROR SUMMARY: 1 error
"""

RACECHECK_LOG = f"""\
========= COMPUTE-SANITIZER
mla_kv-sanitize: begin {DECODE}
========= Warning: Race reported between Write access at {WGMMA}+0x3c10 in attention_sm90.cuh:326
=========     and Read access at {WGMMA}+0x3d80 in attention_sm90.cuh:331 [128 hazards]
=========
========= Error: Race reported between Write access at {WGMMA}+0x5000 in attention_sm90.cuh:467
=========     and Read access at {WGMMA}+0x5100 in attention_sm90.cuh:478 [64 hazards]
=========     and Read access at {WGMMA}+0x5200 in attention.cuh:99 [2 hazards]
=========
mla_kv-sanitize: end {DECODE} ok
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""


def test_memcheck_report_with_its_call_sites_and_summary():
    log = sanitize.parse_log("memcheck", MEMCHECK_LOG)
    assert log.summary_errors == 1 and log.calls_seen == [WRITE, DECODE]
    (r,) = log.reports
    assert r.call == DECODE and r.headline == "Invalid __global__ write of size 4 bytes"
    (site,) = r.sites
    assert [(f.file, f.line) for f in site] == [("arch.cuh", 88), ("attention.cuh", 427)]
    assert site[1].function == SM80


def test_racecheck_reports_have_every_access_as_a_site():
    log = sanitize.parse_log("racecheck", RACECHECK_LOG)
    assert log.summary_errors == 2
    first, second = log.reports
    assert [s[0].line for s in first.sites] == [326, 331]
    assert [(s[0].file, s[0].line) for s in second.sites] == [("attention_sm90.cuh", 467), ("attention_sm90.cuh", 478),
                                                               ("attention.cuh", 99)]
    assert first.functions == [WGMMA, WGMMA] and first.headline.startswith("Warning: Race reported")


@pytest.mark.parametrize("text,function,file,line", [
    ("0x150 in void cudf::count_set_bits_kernel<int=256>(unsigned int const *,int,int,int*)",
     "void cudf::count_set_bits_kernel<int=256>(unsigned int const *,int,int,int*)", None, None),
    ("0xa0a50 in /usr/local/cuda/include/cub/thread/thread_load.cuh:272:ThreadLoad<LOAD_CG,const unsigned int *>",
     "ThreadLoad<LOAD_CG,const unsigned int *>", "/usr/local/cuda/include/cub/thread/thread_load.cuh", 272),
    ("compress(const unsigned int *, uint2 *, int)+0x260", "compress(const unsigned int *, uint2 *, int)", None, None),
    ("void f<(int)0>(T1 &, int)+0x8a70 in /home/x/thread_load.cuh:260 [4 hazards]", "void f<(int)0>(T1 &, int)",
     "/home/x/thread_load.cuh", 260),
])
def test_locations_of_old_and_new_tool_versions(text, function, file, line):
    frame = sanitize.parse_location(text)
    assert (frame.function, frame.file, frame.line) == (function, file, line)


def test_unknown_tool_messages_are_reports():
    log = sanitize.parse_log("memcheck", "========= COMPUTE-SANITIZER\n"
                                         "========= Error: Target application terminated before first instrumented "
                                         "API call\n")
    (r,) = log.reports
    assert r.headline == "Error: Target application terminated before first instrumented API call"
    assert log.summary_errors is None


def test_allow_list_entries_and_their_errors():
    entries = sanitize.parse_allow_list(
        "# comment\n\n"
        "racecheck | attention_wgmma_kernel | attention_sm90.cuh:326-331 | ordered by named barrier 3\n"
        "racecheck | re:wgmma_kernel<__half | attention_sm90.cuh:467,478;attention.cuh:99 | reason  # trailing\n"
        "memcheck | * | * | anything\n")
    assert [(e.tool, e.kernel, e.line) for e in entries] == [
        ("racecheck", "attention_wgmma_kernel", 3), ("racecheck", "re:wgmma_kernel<__half", 4), ("memcheck", "*", 5)]
    assert entries[1].sites == {"attention_sm90.cuh": [(467, 467), (478, 478)], "attention.cuh": [(99, 99)]}
    assert entries[2].sites is None
    for bad, message in [("racecheck | k | f.cuh:1 |", "needs a reason"),
                         ("racecheck | k | f.cuh:1", "3 fields"),
                         ("memchek | k | f.cuh:1 | r", "tool must be"),
                         ("memcheck |  | f.cuh:1 | r", "kernel field"),
                         ("memcheck | re:( | f.cuh:1 | r", "bad regex"),
                         ("memcheck | k | f.cuh:9-3 | r", "empty range"),
                         ("memcheck | k | f.cuh:x | r", "bad line"),
                         ("memcheck | k | 12 | r", "FILE:LINE")]:
        with pytest.raises(sanitize.AllowListError, match=message):
            sanitize.parse_allow_list("# header\n" + bad + "\n", "allow.txt")
    with pytest.raises(sanitize.AllowListError, match="allow.txt:2"):
        sanitize.parse_allow_list("# header\nracecheck | k | f.cuh:1 |\n", "allow.txt")


def test_a_report_matches_when_every_site_is_covered():
    first, second = sanitize.parse_log("racecheck", RACECHECK_LOG).reports
    (mem,) = sanitize.parse_log("memcheck", MEMCHECK_LOG).reports
    entries = sanitize.parse_allow_list(
        "racecheck | attention_wgmma_kernel | attention_sm90.cuh:326-331 | r\n"
        "racecheck | attention_wgmma_kernel | attention_sm90.cuh:467,478 | r\n"
        "racecheck | re:wgmma_kernel<__half | attention_sm90.cuh:467,478;attention.cuh:99 | r\n"
        "memcheck | Sm80 | attention.cuh:427 | r\n"
        "racecheck | Sm80 | * | r\n")
    assert [first.matches(e) for e in entries] == [True, False, False, False, False]
    assert [second.matches(e) for e in entries] == [False, False, True, False, False]
    assert [mem.matches(e) for e in entries] == [False, False, False, True, False]  # through its device frame


def _write_run(directory: Path, tool: str, log: str, records, rc=0, done=True, shard=0):
    run = directory / tool / f"shard{shard}"
    run.mkdir(parents=True)
    (run / "log.txt").write_text(log)
    (run / "rc").write_text(f"{rc}\n")
    lines = [json.dumps(r) for r in records] + ([json.dumps(dict(done=True, calls=len(records)))] if done else [])
    (run / "calls.jsonl").write_text("\n".join(lines) + "\n")


def _record(call, ok=True):
    return dict(call=call, ok=ok, problems=[] if ok else ["decode: wrong"], canary_bytes=0, seconds=0.1)


def test_report_table_and_verdict(tmp_path, capsys):
    _write_run(tmp_path, "racecheck", RACECHECK_LOG, [_record(DECODE)], rc=99)
    allow = tmp_path / "allow.txt"
    allow.write_text("racecheck | wgmma | attention_sm90.cuh:326-331 | r\n")
    assert sanitize.report(tmp_path, allow, ["racecheck"]) == 1
    out = capsys.readouterr().out
    assert "FAIL 1r +1a" in out and "sanitize: FAIL" in out and "attention.cuh:99" in out
    allow.write_text("racecheck | wgmma | attention_sm90.cuh:326-331,467,478;attention.cuh:99 | r\n")
    assert sanitize.report(tmp_path, allow, ["racecheck"]) == 0
    out = (tmp_path / "table.txt").read_text()
    assert f"{DECODE}" in out and "ok +2a" in out and "sanitize: ok" in out


def test_report_fails_on_wrong_results_unfinished_runs_and_hidden_reports(tmp_path, capsys):
    _write_run(tmp_path, "memcheck", MEMCHECK_LOG, [_record(WRITE), _record(DECODE, ok=False)], rc=99)
    _write_run(tmp_path, "initcheck", "========= COMPUTE-SANITIZER\n", [_record(WRITE)], rc=137, done=False)
    hidden = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 5 errors\n"
    _write_run(tmp_path, "synccheck", hidden, [_record(WRITE)])
    _write_run(tmp_path, "synccheck", "========= ERROR SUMMARY: 0 errors\n", [_record(DECODE)], shard=1)
    allow = tmp_path / "allow.txt"
    allow.write_text("memcheck | Sm80 | attention.cuh:427 | r\n")
    assert sanitize.report(tmp_path, allow, ["memcheck", "initcheck", "synccheck", "racecheck"]) == 1
    out = capsys.readouterr().out
    assert "FAIL check +1a" in out and "1 calls wrong" in out
    assert "shard0: exit 137 (timeout), unfinished, no summary line" in out
    assert "shard0: its summary counts 5 reports, its log shows 0 (raise --print-limit)" in out
    assert "racecheck  0 reports (0 allowed), 0 calls: FAIL no run" in out


def test_a_shard_clean_alone_passes(tmp_path):
    clean = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
    _write_run(tmp_path, "synccheck", clean, [_record(WRITE)], rc=0)
    _write_run(tmp_path, "synccheck", clean, [_record(DECODE)], rc=0, shard=1)
    allow = tmp_path / "allow.txt"
    allow.write_text("# nothing allowed\n")
    assert sanitize.report(tmp_path, allow, ["synccheck"]) == 0


def test_a_shard_without_calls_is_no_failure(tmp_path):
    # --only selecting fewer calls than a tool's shards leaves a process with none; compute-sanitizer
    # then exits 255 with one error line, which says nothing of a kernel
    clean = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
    empty = ("========= COMPUTE-SANITIZER\n"
             "========= Error: Target application terminated before first instrumented API call\n")
    _write_run(tmp_path, "racecheck", clean, [_record(DECODE)], rc=0)
    _write_run(tmp_path, "racecheck", empty, [], rc=255, shard=1)
    allow = tmp_path / "allow.txt"
    allow.write_text("# nothing allowed\n")
    assert sanitize.report(tmp_path, allow, ["racecheck"]) == 0
    # the same log from a shard that had calls (and lost them) still fails
    _write_run(tmp_path, "racecheck", empty, [_record(WRITE)], rc=255, done=False, shard=2)
    assert sanitize.report(tmp_path, allow, ["racecheck"]) == 1


def test_shards_split_a_selection_evenly(monkeypatch, tmp_path):
    every = [n for n, _ in sanitize.calls()]
    names = [n for n in every if n.startswith("quantized/") and "/best/" in n]
    assert len(names) >= 3
    given = {}

    def fake_run(case, device, index):  # records which calls each shard was given
        given.setdefault(shard, []).append(every[index])
        return type("Outcome", (), dict(problems=[], canary_bytes=0, fatal=False))()

    monkeypatch.setattr(sanitize._sweep_cases(), "run", fake_run)
    for shard in range(3):
        assert sanitize.run_calls(tmp_path / f"s{shard}.jsonl", "quantized/.*/best", (shard, 3), "cpu") == 0
    assert sorted(c for calls in given.values() for c in calls) == sorted(names)
    assert max(map(len, given.values())) - min(map(len, given.values())) <= 1


def test_marked_sites_and_their_errors():
    text = ("a;  // sanitize-allow: one\n"
            "b;  // why; sanitize-allow: two {\n"
            "c;\n"
            "d;  // sanitize-allow: two }; sanitize-allow: one\n")
    assert sanitize.marked_sites(text, "f.cuh") == {"one": [(1, 1), (4, 4)], "two": [(2, 4)]}
    for bad, message in [("// sanitize-allow: x {\n// sanitize-allow: x {\n", "f.cuh:2: site @x opened again"),
                         ("// sanitize-allow: x }\n", "f.cuh:1: site @x closed but not opened"),
                         ("\n// sanitize-allow: x {\n", "f.cuh:2: site @x opened but never closed")]:
        with pytest.raises(sanitize.AllowListError, match=message):
            sanitize.marked_sites(bad, "f.cuh")
    sources = {"k.cuh": sanitize.marked_sites(text, "k.cuh")}
    (entry,) = sanitize.parse_allow_list("racecheck | k | k.cuh:@two,9;a.cuh:3 | r\n", "allow.txt", sources)
    assert entry.sites == {"k.cuh": [(2, 4), (9, 9)], "a.cuh": [(3, 3)]}
    for sites in ("k.cuh:@three", "other.cuh:@one"):
        with pytest.raises(sanitize.AllowListError, match="allow.txt:1: no line of .* marks site @"):
            sanitize.parse_allow_list(f"racecheck | k | {sites} | r\n", "allow.txt", sources)


def test_sources_sharing_a_name_fail_only_an_entry_that_names_a_site_there(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / "csrc" / sub).mkdir(parents=True)
        (tmp_path / "csrc" / sub / "same.cuh").write_text("x;  // sanitize-allow: one\n")
    (tmp_path / "csrc" / "a" / "own.cuh").write_text("y;\nz;  // sanitize-allow: one\n")
    sources = sanitize.source_sites(tmp_path / "csrc")
    assert sources == {"same.cuh": None, "own.cuh": {"one": [(2, 2)]}}
    (entry,) = sanitize.parse_allow_list("racecheck | k | own.cuh:@one;same.cuh:7 | r\n", "allow.txt", sources)
    assert entry.sites == {"own.cuh": [(2, 2)], "same.cuh": [(7, 7)]}
    with pytest.raises(sanitize.AllowListError, match="allow.txt:1: several sources are named same.cuh"):
        sanitize.parse_allow_list("racecheck | k | same.cuh:@one | r\n", "allow.txt", sources)


def test_allow_list_pins_the_hopper_handoffs_it_names():
    """The racecheck entries name lines of the Hopper kernels' headers (by the sites their comments mark):
    each line must still touch a shared buffer the entry's reason names first ("max_s:",
    "m_s / l_s / corr_s (...)"), else the entry allows a different access than it says (or none)."""
    repo = Path(__file__).resolve().parent.parent
    headers = ("attention_sm90.cuh", "attention_sm90_narrow.cuh")
    sources = {h: (repo / "csrc/kernels/attention" / h).read_text().splitlines() for h in headers}
    entries = [e for e in sanitize.parse_allow_list((repo / "scripts/sanitize-allow.txt").read_text())
               if e.sites and any(h in e.sites for h in headers)]
    assert {h for e in entries for h in headers if h in e.sites} == set(headers)
    for entry in entries:
        names = re.split(r"[:(]", entry.reason, maxsplit=1)[0].replace("/", " ").split()
        for header in headers:
            for lo, hi in entry.sites.get(header, []):
                for number in range(lo, hi + 1):
                    line = sources[header][number - 1]
                    assert any(name in line for name in names), (
                        f"sanitize-allow.txt:{entry.line}: {header}:{number} no longer touches {' / '.join(names)}: "
                        f"{line.strip()!r}")