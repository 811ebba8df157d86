"""The documents say what is true now: bench/RESULTS.md is the current results page (short, every table
dated and its GPU named, a Targets table of one-line cells), docs/design-notes.md is the design (no history
table), and no file of the source, tests or documents speaks of how the work was organised.

CPU only, no import of mla_kv. Each check is a function returning the problems it found; the tests run it
on the repository's files and, so that every check is seen to fail, on a sample written to break it.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
DESIGN = ROOT / "docs" / "design-notes.md"
README = ROOT / "README.md"

MAX_RESULTS_LINES = 450
MAX_TARGET_CELL = 200
TREES = ("csrc", "python", "scripts", "tests", "docs", "bench", "README.md", "CHANGELOG.md")
TEXT_SUFFIXES = {"", ".py", ".md", ".txt", ".cu", ".cuh", ".h", ".cpp", ".cc", ".json", ".toml", ".cfg",
                 ".sh", ".cmake", ".yml", ".yaml", ".in"}

# Built from pieces so that this file does not match its own patterns.
_WORD = "sess" + "ion"
# The done-when rule: the word followed by a number, or the past tense of "lend", as whole words
# (`grep -rniwE`); the planner's `<word>_len` (an engine's term for the longest context) does not match.
NUMBERED = re.compile(r"(?<![\w])(" + _WORD + r"s? [0-9]+|l" + r"ent)(?![\w])", re.IGNORECASE)
# Any other use of the word ("this ...", "a later ..."); identifiers (`<word>_len`, `kSessionLen`,
# `start_new_<word>`) have no word boundary there, and an engine's "<word> length" is its own term.
ANY_USE = re.compile(r"\b" + _WORD + r"s?\b(?! length)", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
GPU = re.compile(r"\b(H100|H200|A100|A10|L40|T4|V100)s?\b")


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def _sections(lines):
    """(heading, body lines) for each '## ' section."""
    out, head, body = [], None, []
    for line in lines:
        if line.startswith("## "):
            if head is not None:
                out.append((head, body))
            head, body = line[3:].strip(), []
        elif head is not None:
            body.append(line)
    if head is not None:
        out.append((head, body))
    return out


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _is_rule(line):
    return bool(re.fullmatch(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?", line.strip()))


def _tables(lines):
    """Each Markdown table as (header cells, row cell lists)."""
    out, i = [], 0
    while i + 1 < len(lines):
        if lines[i].lstrip().startswith("|") and _is_rule(lines[i + 1]):
            header, rows, j = _cells(lines[i]), [], i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            out.append((header, rows))
            i = j
        else:
            i += 1
    return out


# ---- the checks ----

def results_length_problems(lines):
    return [f"{len(lines)} lines, more than {MAX_RESULTS_LINES}"] if len(lines) > MAX_RESULTS_LINES else []


def history_table_problems(lines):
    """A history: a heading or table header about past runs, a table whose first column is a run's
    number or a date, or a row that starts with one."""
    problems = []
    for n, line in enumerate(lines, 1):
        s = line.strip()
        if re.match(r"#+\s*(" + _WORD + r"s|history)\b", s, re.IGNORECASE):
            problems.append(f"line {n}: history heading: {s[:80]}")
        if re.match(r"\|\s*(" + _WORD + r"|date|section)\s*\|", s, re.IGNORECASE):
            problems.append(f"line {n}: history table header: {s[:80]}")
    for header, rows in _tables(lines):
        first = [r[0] for r in rows if r]
        if first and all(DATE.fullmatch(c) or re.fullmatch(r"\d+(-\d+)?", c) for c in first) and \
                header[0].lower() not in ("b", "t", "rows", "cp", "h"):
            problems.append(f"table '{' | '.join(header)[:60]}': every row starts with a run number or date")
    return problems


def wording_problems(text, where):
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        if NUMBERED.search(line) or ANY_USE.search(line):
            problems.append(f"{where}:{n}: {line.strip()[:100]}")
    return problems


def target_cell_problems(lines):
    sections = dict(_sections(lines))
    if "Targets" not in sections:
        return ["no '## Targets' section"]
    tables = _tables(sections["Targets"])
    if not tables:
        return ["the Targets section has no table"]
    header, rows = tables[0]
    problems = []
    if [h.lower() for h in header[:1] + header[-3:]] != ["target", "goal", "measured", "met"]:
        problems.append(f"Targets header is {header}, not target .. goal, measured, met")
    for row in rows:
        if len(row) != len(header):
            problems.append(f"row of {len(row)} cells under {len(header)} columns: {row[0][:60]}")
        for cell in row:
            if len(cell) >= MAX_TARGET_CELL:
                problems.append(f"cell of {len(cell)} characters: {cell[:60]}...")
    return problems


def dated_table_problems(lines):
    """Each section of RESULTS.md that holds a table names a date and a GPU."""
    problems = []
    for head, body in _sections(lines):
        if head == "Targets" or not _tables(body):
            continue
        text = "\n".join([head] + body)
        if not DATE.search(text):
            problems.append(f"section '{head}' has a table but no date")
        if not GPU.search(text):
            problems.append(f"section '{head}' has a table but names no GPU")
    return problems


def readme_problems(lines):
    problems = []
    heads = [(n, l[3:].strip()) for n, l in enumerate(lines) if l.startswith("## ")]
    names = [h for _, h in heads]
    for want in ("Performance", "Kernel variants by arch tag"):
        if want not in names:
            problems.append(f"README has no '## {want}' section")
        elif names.index(want) > 2:
            problems.append(f"README's '## {want}' is section {names.index(want) + 1}, not near the top")
    perf = dict(_sections(lines)).get("Performance", [])
    if not any("bench/RESULTS.md" in l for l in perf):
        problems.append("README's Performance section does not link to bench/RESULTS.md")
    if not _tables(perf):
        problems.append("README's Performance section has no table")
    return problems


def _tree_files():
    for name in TREES:
        p = ROOT / name
        if p.is_file():
            yield p
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts and f.suffix in TEXT_SUFFIXES:
                    yield f


# ---- on the repository ----

def test_results_is_short():
    assert results_length_problems(_lines(RESULTS)) == []


def test_results_has_no_history():
    assert history_table_problems(_lines(RESULTS)) == []


def test_design_notes_have_no_history_table():
    assert history_table_problems(_lines(DESIGN)) == []


def test_targets_are_one_short_line_each():
    assert target_cell_problems(_lines(RESULTS)) == []


def test_results_tables_are_dated_and_name_their_gpu():
    assert dated_table_problems(_lines(RESULTS)) == []


def test_readme_performance_and_variants_near_the_top():
    assert readme_problems(_lines(README)) == []


def test_no_words_of_how_the_work_was_organised():
    problems = []
    for f in _tree_files():
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        problems += wording_problems(text, str(f.relative_to(ROOT)))
    assert problems == []


# ---- each check fails on a sample written to break it ----

BAD_TARGETS = """## Targets

| target | goal | measured | met |
| --- | --- | --- | --- |
| decode | >= 80% | {} | no |
""".format("x" * MAX_TARGET_CELL).splitlines()


@pytest.mark.parametrize("check, sample", [
    (results_length_problems, ["line"] * (MAX_RESULTS_LINES + 1)),
    (history_table_problems, ["## " + _WORD.title() + "s", ""]),
    (history_table_problems, ["| " + _WORD + " | date | what |", "| --- | --- | --- |",
                              "| 1 | 2026-11-29 | x |"]),
    (history_table_problems, ["| run | what |", "| --- | --- |", "| 2026-11-29 | x |", "| 2026-12-02 | y |"]),
    (target_cell_problems, BAD_TARGETS),
    (target_cell_problems, ["## Write", "text"]),
    (dated_table_problems, ["## Decode", "", "| B | us |", "| --- | --- |", "| 1 | 2.0 |"]),
    (readme_problems, ["# x", "## Set up and run", "text"]),
])
def test_check_fails_on_a_bad_sample(check, sample):
    assert check(sample) != []


@pytest.mark.parametrize("line", [
    "Measured in " + _WORD + " 29 on the H100.",
    "RESULTS.md, " + _WORD + "s 28-29",
    "no GPU was l" + "ent",
    "left for a later " + _WORD,
    "this " + _WORD + "'s last commit",
])
def test_wording_check_fails_on(line):
    assert wording_problems(line, "sample") != []


@pytest.mark.parametrize("line", [
    "layout  max tokens  " + _WORD + "_len",
    "the engine's " + _WORD + " length bounds it",
    "std::vector<float> t(size_t(kSessionLen) * kRopeDim);",
    "subprocess.Popen(cmd, start_new_" + _WORD + "=True)",
    "Measured on an H100 on 2026-12-06.",
])
def test_wording_check_allows(line):
    assert wording_problems(line, "sample") == []
