"""The mutation list of scripts/mutate (scripts/mutations.py), checked without a GPU or a build: every
mutation names text that occurs where it says in its kernel file and applies to exactly that place,
names existing test files, and together they cover every kernel family, topic and arch variant."""
import subprocess
import sys
from pathlib import Path

import pytest

import mutate as MUTATE

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "mutate"


CATALOG = MUTATE.load_mutations_module()
MUTATIONS = CATALOG.MUTATIONS


def test_at_least_30_mutations_with_distinct_ids():
    ids = [m.id for m in MUTATIONS]
    assert len(ids) >= 30
    assert len(set(ids)) == len(ids), "duplicate ids"


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.id)
def test_mutation_is_valid_and_applies_to_its_place_only(m):
    assert MUTATE.mutation_problems(m, CATALOG) == []
    text = (REPO / m.file).read_text()
    at = MUTATE.occurrence_offset(text, m)
    mutated = MUTATE.mutated_text(text, m)
    assert mutated != text
    assert mutated[:at] == text[:at], "text before the occurrence changed"
    assert mutated[at + len(m.replacement):] == text[at + len(m.original):], "text after it changed"
    changed = [i for i, (a, b) in enumerate(zip(text.splitlines(), mutated.splitlines())) if a != b]
    assert changed == [MUTATE.mutation_line(text, m) - 1], "exactly one line changes"
    assert len(mutated.splitlines()) == len(text.splitlines())


def test_mutations_cover_every_family_topic_and_arch_variant():
    families = {m.family for m in MUTATIONS}
    assert families == set(CATALOG.FAMILIES)
    topics = {t for m in MUTATIONS for t in m.topics}
    required = {"plain write", "fused write", "paged slots", "block pointers", "paged table", "decode", "prefill",
                "mask", "guard", "rescale", "lse", "split", "rope", "rmsnorm", "TMA", "cp.async", "mma"}
    assert required <= topics, f"topics without a mutation: {required - topics}"
    # Each arch variant has mutations in code only it runs (Sm70: mma.m8n8k4, Sm75: m16n8k8,
    # Sm80: the bf16 m16n8k16 path and the cp.async ring, Sm90: the wgmma kernel).
    for arch in CATALOG.ARCHS:
        assert any(m.archs == (arch,) for m in MUTATIONS), f"no {arch}-only mutation"
    assert {m.file for m in MUTATIONS} >= {CATALOG.WRITE_CUH, CATALOG.GATHER_CUH, CATALOG.COMMON_CUH,
                                           CATALOG.MMA_SYNC_CUH, CATALOG.COMBINE_CU, CATALOG.SM90_CUH, CATALOG.MERGE_CU, CATALOG.ATTENTION_CU,
                                           CATALOG.MMA_CUH, CATALOG.WGMMA_CUH, CATALOG.ADDRESS_CUH}


def test_occurrence_picks_the_nth_of_repeated_text():
    m = CATALOG.Mutation("x", "write", ("Sm80",), ("guard",), "f", "ab", "XY", ("t",), "d", occurrence=2)
    assert MUTATE.mutated_text("ab-ab-ab", m) == "ab-XY-ab"
    with pytest.raises(MUTATE.MutationError):
        MUTATE.occurrence_offset("ab", m)  # an occurrence index needs repeated text
    unique = CATALOG.Mutation("x", "write", ("Sm80",), ("guard",), "f", "ab", "XY", ("t",), "d")
    with pytest.raises(MUTATE.MutationError):
        MUTATE.occurrence_offset("ab-ab", unique)


def run_script(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          cwd="/")


def test_list_runs_without_gpu_or_build():
    result = run_script("--list")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"{len(MUTATIONS)} mutations; family:")
    for m in MUTATIONS:
        assert m.id in result.stdout
    assert "INVALID" not in result.stdout


def test_only_selects_and_rejects_unknown_ids():
    picked = [MUTATIONS[0].id, MUTATIONS[-1].id]
    result = run_script("--list", "--only", ",".join(picked))
    assert result.returncode == 0 and result.stdout.startswith("2 mutations;")
    result = run_script("--list", "--only", "no-such-mutation")
    assert result.returncode == 2 and "unknown mutation ids" in result.stderr


def test_pytest_log_reading(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("$ python -m pytest ...\n..F\n=== short test summary info ===\n"
                   "FAILED ../../work/main/tests/test_attention.py::test_decode[fp16-1] - AssertionError: x\n"
                   "1 failed, 2 passed in 3.1s\n$ python -m pytest ...\n5 passed, 3 deselected in 1.0s\n")
    assert MUTATE.first_failure(log) == "test_attention.py::test_decode[fp16-1]"
    assert MUTATE.tests_passed(log) == 7
