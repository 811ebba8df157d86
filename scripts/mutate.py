#!/usr/bin/env python3
"""The project's mutation check of its kernels.

Every mutation in scripts/mutations.py (one changed line of csrc/kernels/) is built into its own copy
of the extension and run against the test files that must kill it; a mutant whose tests all pass
shows a hole in the tests. Built to finish within a few minutes of GPU time:
  - the baseline is configured and built once with CMake + Ninja in a copy of the source tree;
  - a mutant recompiles only the objects whose recorded dependencies (ninja -t deps) include its
    file, by the baseline's own commands pointed at the mutant's copy, then re-runs the archive and
    link commands; every mutant's compiles share one pool of --jobs processes;
  - tests run --test-jobs mutants at a time on the one GPU, next to the baseline's (started first),
    each mutant from a package directory of its own; a run stops at its first failing test, and a
    mutation's focus tests (pytest -k) run before the rest of its files.
Every selected test file must pass on the baseline, else the run aborts: the tests are broken, not
the mutants. Verdicts: killed (a test failed; "crash" and "timeout" say how it ended when not by a
failed assertion), survived (every test passed), error (a build failed, pytest could not run the
tests), not run (the run was aborted or reached --deadline first).

Usage: scripts/mutate [--list] [--only ID,...] [--jobs N] [--test-jobs N] [--out DIR] [--build-only]
Writes mutate-logs/, mutate.txt and mutate.md (the table for bench/RESULTS.md) to --out (default
$OUT, else /tmp/mla_kv_out/mutate). Exit status: 0 every mutant killed (or, --build-only, built),
1 any other verdict, 2 bad arguments, an invalid mutation list, a failed or unfinished baseline.
"""

import argparse
import concurrent.futures
import datetime
import importlib.util
import itertools
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MUTATIONS_FILE = REPO / "scripts" / "mutations.py"
WORK_MARKER = ".mla_kv_mutate"
# pytest exit codes (pytest.ExitCode): 0 all passed, 1 some failed, 5 none collected; the others
# (interrupted, internal error, usage error) mean the tests did not run.
PYTEST_PASSED, PYTEST_FAILED, PYTEST_NO_TESTS = 0, 1, 5


def load_mutations_module():
    spec = importlib.util.spec_from_file_location("mla_kv_mutations", MUTATIONS_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while processing the class
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------- mutations
class MutationError(Exception):
    pass


def occurrence_offset(text, m):
    """Where `m.original` starts in `text`: its only occurrence, or the m.occurrence-th."""
    offsets, at = [], text.find(m.original)
    while at >= 0:
        offsets.append(at)
        at = text.find(m.original, at + 1)
    if m.occurrence == 0:
        if len(offsets) != 1:
            raise MutationError(f"{m.file}: original text occurs {len(offsets)} times, not once")
        return offsets[0]
    if len(offsets) < 2 or m.occurrence > len(offsets):
        raise MutationError(f"{m.file}: occurrence {m.occurrence} of a text that occurs {len(offsets)} times")
    return offsets[m.occurrence - 1]


def mutated_text(text, m):
    at = occurrence_offset(text, m)
    return text[:at] + m.replacement + text[at + len(m.original):]


def mutation_line(text, m):
    return text.count("\n", 0, occurrence_offset(text, m)) + 1


def mutation_problems(m, catalog, root=REPO):
    """Why mutation m cannot run (empty: it can)."""
    problems = []
    if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", m.id):
        problems.append("id: lowercase words joined by '-'")
    if "\n" in m.original or "\n" in m.replacement or "\n" in m.description:
        problems.append("original, replacement and description are one line each")
    if m.original == m.replacement:
        problems.append("the replacement equals the original")
    if m.family not in catalog.FAMILIES:
        problems.append(f"family {m.family!r} not in {catalog.FAMILIES}")
    problems += [f"arch {a!r} not in {catalog.ARCHS}" for a in m.archs if a not in catalog.ARCHS]
    problems += [f"topic {t!r} not in TOPICS" for t in m.topics if t not in catalog.TOPICS]
    if not m.tests:
        problems.append("no test files")
    problems += [f"test file {t} does not exist" for t in m.tests if not (root / t).is_file()]
    path = root / m.file
    if not m.file.startswith("csrc/kernels/") or not path.is_file():
        problems.append(f"{m.file} is not a file under csrc/kernels/")
    else:
        try:
            occurrence_offset(path.read_text(), m)
        except MutationError as e:
            problems.append(str(e))
    return problems


def arch_label(archs, catalog):
    return "all" if tuple(archs) == catalog.ARCHS else "/".join(archs)


# ------------------------------------------------------------------------------- processes
class Stopped(Exception):
    """The run was aborted or reached its deadline before this step."""


@dataclass
class Outcome:
    rc: int
    seconds: float
    timed_out: bool = False


class Runner:
    """Runs subprocesses in their own process groups, so that an abort, the deadline or a timeout
    ends each with everything it started (nvcc's cicc/ptxas, a test's worker processes)."""

    def __init__(self, deadline_at):
        self.deadline_at = deadline_at
        self.aborted = threading.Event()
        self._procs = set()
        self._lock = threading.Lock()

    @property
    def stopped(self):
        return self.aborted.is_set() or time.monotonic() >= self.deadline_at

    def abort(self):
        self.aborted.set()
        with self._lock:
            for proc in self._procs:
                _kill_group(proc)

    def run(self, cmd, *, cwd, log_path, env=None, shell=False, limit=lambda: None):
        """Runs cmd with stdout and stderr appended to log_path. limit() is re-read while it runs:
        seconds it may take, or None for no limit. Raises Stopped when cut by an abort or the deadline."""
        if self.stopped:
            raise Stopped()
        start = time.monotonic()
        with open(log_path, "ab") as log:
            log.write(f"$ {cmd if shell else ' '.join(map(str, cmd))}\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, shell=shell, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            with self._lock:
                self._procs.add(proc)
            try:
                while True:
                    try:
                        rc = proc.wait(timeout=0.5)
                        return Outcome(rc, time.monotonic() - start)
                    except subprocess.TimeoutExpired:
                        pass
                    seconds = time.monotonic() - start
                    if self.stopped:
                        _kill_group(proc)
                        proc.wait()
                        raise Stopped()
                    allowed = limit()
                    if allowed is not None and seconds > allowed:
                        _kill_group(proc)
                        proc.wait()
                        return Outcome(proc.returncode, seconds, timed_out=True)
            finally:
                with self._lock:
                    self._procs.discard(proc)


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class PriorityPool:
    """Worker threads running submitted callables, the lowest priority first (FIFO among equals):
    a mutant's link jumps ahead of other mutants' compiles, so its tests can start early."""

    def __init__(self, workers):
        self._queue = queue.PriorityQueue()
        self._order = itertools.count()
        for _ in range(workers):
            threading.Thread(target=self._work, daemon=True).start()

    def submit(self, priority, fn):
        future = concurrent.futures.Future()
        self._queue.put((priority, next(self._order), fn, future))
        return future

    def _work(self):
        while True:
            _, _, fn, future = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the waiting thread
                future.set_exception(e)


# ------------------------------------------------------------------------------- builds
class BuildError(Exception):
    pass


def find_cuda_compiler():
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def build_baseline(runner, src, build, archs, jobs, log_path):
    """Configures and builds the extension from src into build; returns its module's path."""
    try:
        import pybind11
    except ImportError as e:
        raise BuildError("pybind11 is not importable (pip install pybind11)") from e
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise BuildError(f"{tool} not found on PATH")
    configure = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DMLA_KV_BUILD_PYTHON=ON", "-DMLA_KV_BUILD_ENGINE_STEP=OFF", f"-DMLA_KV_CUDA_ARCHS={archs}",
                 "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                 f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"]
    nvcc = find_cuda_compiler()
    if nvcc:
        configure.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    for cmd in (configure, ["ninja", "-C", str(build), f"-j{jobs}"]):
        if runner.run(cmd, cwd=src, log_path=log_path).rc != 0:
            raise BuildError(f"baseline build failed (log: {log_path})")
    modules = sorted(build.glob("_C*.so"))
    if not modules:
        raise BuildError(f"the build made no _C module: no CUDA compiler found? (log: {log_path})")
    return modules[0]


@dataclass
class BuildGraph:
    """The baseline build's steps, from ninja: each object's compile command and dependencies, then
    the archive and link commands that make the module."""
    src: Path
    build: Path
    module: Path
    objects: dict  # object path relative to build -> (compile command, frozenset of resolved dependency paths)
    link_commands: list

    def affected_objects(self, file):
        target = (self.src / file).resolve()
        return [obj for obj, (_, deps) in self.objects.items() if target in deps]


def _ninja(build, *args):
    return subprocess.run(["ninja", "-C", str(build), "-t", *args], check=True, capture_output=True,
                          text=True).stdout


def read_build_graph(src, build, module):
    deps, target = {}, None
    for line in _ninja(build, "deps").splitlines():
        if line and not line[0].isspace():
            target = line.split(": #deps", 1)[0] if ": #deps" in line else None
            if target is not None:
                deps[target] = set()
        elif line.strip() and target is not None:
            deps[target].add(Path(line.strip()).resolve())
    objects = {obj: (_ninja(build, "commands", "-s", obj).strip(), frozenset(paths))
               for obj, paths in deps.items() if obj.endswith(".o")}
    compiles = {command for command, _ in objects.values()}
    chain = _ninja(build, "commands", module.name).splitlines()
    link_commands = [command for command in chain if command.strip() and command not in compiles]
    if not objects or not link_commands:
        raise BuildError("could not read the baseline's objects and link steps from ninja")
    return BuildGraph(src, build, module, objects, link_commands)


def build_mutant(m, graph, mutant_dir, pool, order, runner):
    """Builds m's module in mutant_dir from a mutated copy of the sources; returns its path."""
    src, build = mutant_dir / "src", mutant_dir / "build"
    shutil.copytree(graph.src / "csrc", src / "csrc")
    shutil.copytree(graph.src / "cmake", src / "cmake")  # the ptxas launcher the compile commands call
    path = src / m.file
    path.write_text(mutated_text(path.read_text(), m))
    affected = graph.affected_objects(m.file)
    if not affected:
        raise BuildError(f"no object of the build depends on {m.file}")
    for obj in graph.objects:
        (build / obj).parent.mkdir(parents=True, exist_ok=True)
        if obj not in affected:
            (build / obj).symlink_to(graph.build / obj)

    def retarget(command):
        return command.replace(f"{graph.src}/", f"{src}/").replace(str(graph.build), str(build))

    def step(command, log_name):
        def run():
            outcome = runner.run(retarget(command), cwd=build, log_path=build / log_name, shell=True)
            if outcome.rc != 0:
                raise BuildError(f"{log_name[:-4]} failed: {(build / log_name).read_text()[-3000:]}")
        return run

    futures = [pool.submit((1, order), step(graph.objects[obj][0], f"compile-{i}.log")) for i, obj in enumerate(affected)]
    for future in futures:
        future.result()
    for i, command in enumerate(graph.link_commands):
        pool.submit((0, order), step(command, f"link-{i}.log")).result()
    return build / graph.module.name, len(affected)


def make_package(root, python_src, build_info, module):
    """root/mla_kv: the Python sources, the build info and this build's module, as an install has them."""
    package = root / "mla_kv"
    shutil.copytree(python_src, package, ignore=shutil.ignore_patterns("*.in", "__pycache__"))
    shutil.copy2(build_info, package / "_build_info.py")
    shutil.copy2(module, package / module.name)
    return root


# ------------------------------------------------------------------------------- tests
def test_env(package_root):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(package_root), env.get("PYTHONPATH")) if p)
    env["MLA_KV_REQUIRE_GPU"] = "1"  # a missing GPU or kernel build fails instead of skipping
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # concurrent runs share tests/
    # A dozen test processes share the CPU cores; torch's default of one thread per core thrashes.
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def pytest_command(files, keyword=None):
    # --rootdir: the repository's conftest and pytest settings; the package comes from PYTHONPATH
    # (the working directory is outside the source tree, so python/mla_kv is not importable).
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
           "--rootdir", str(REPO)]
    if keyword:
        cmd += ["-k", keyword]
    return cmd + [str(REPO / f) for f in files]


def first_failure(log_path):
    """The first failing test of a pytest log (-rfE summary lines), as file::test[params]."""
    for line in log_path.read_text(errors="replace").splitlines():
        found = re.match(r"(?:FAILED|ERROR) (?:\S*/)?([\w.-]+\.py::\S+)", line)
        if found:
            return found.group(1)
    return ""


def tests_passed(log_path):
    """Tests reported passed in a pytest log, over all of its runs ("... 12 passed, 3 deselected in 4.1s")."""
    return sum(int(n) for n in re.findall(r"(\d+) passed\b", log_path.read_text(errors="replace")))


def check_package_imported(runner, package_root, log_path):
    """The test processes must import the package built here, not an installed or source-tree one."""
    probe = "import mla_kv.ops as o; print('imported', o.__file__, getattr(o._C, '__file__', 'no _C'))"
    outcome = runner.run([sys.executable, "-c", probe], cwd=package_root, log_path=log_path,
                         env=test_env(package_root))
    paths = [line.split()[1:] for line in log_path.read_text().splitlines() if line.startswith("imported ")]
    if outcome.rc != 0 or not paths or not all(p.startswith(f"{package_root}/") for p in paths[-1]):
        raise BuildError(f"the tests would not import the package under {package_root} (log: {log_path}); "
                         "an editable install (pip install -e) shadows PYTHONPATH: install non-editable")


@dataclass
class Verdict:
    status: str  # killed, survived, error, not run, built
    note: str = ""
    test_seconds: float = 0.0
    build_seconds: float = 0.0
    objects: int = 0


def run_kill_tests(m, package_root, runner, log_path, limit):
    """Runs m's focus tests, then the rest of its files, stopping at the first failure."""
    env = test_env(package_root)
    passes = [m.focus, f"not ({m.focus})"] if m.focus else [None]
    seconds, ran = 0.0, False
    for i, keyword in enumerate(passes):
        def remaining():
            allowed = limit()
            return None if allowed is None else allowed - seconds
        outcome = runner.run(pytest_command(m.tests, keyword), cwd=package_root, env=env, log_path=log_path,
                             limit=remaining)
        seconds += outcome.seconds
        if outcome.timed_out:
            return Verdict("killed", f"timeout after {seconds:.0f} s", seconds)
        if outcome.rc < 0:
            return Verdict("killed", f"crash: signal {-outcome.rc}", seconds)
        if outcome.rc == PYTEST_FAILED:
            failed = first_failure(log_path)
            crashed = re.search(r"illegal (memory )?(address|access)|unspecified launch failure",
                                log_path.read_text(errors="replace"))
            return Verdict("killed", ("crash (CUDA error): " if crashed else "") + failed, seconds)
        if outcome.rc == PYTEST_NO_TESTS and i == 0 and keyword:
            passes[1] = None  # the focus matched nothing: the second pass runs every test
            continue
        if outcome.rc not in (PYTEST_PASSED, PYTEST_NO_TESTS):
            return Verdict("error", f"pytest exit {outcome.rc} (log: {log_path.name})", seconds)
        ran = ran or outcome.rc == PYTEST_PASSED
    if not ran:
        return Verdict("error", "no tests collected", seconds)
    return Verdict("survived", f"{tests_passed(log_path)} tests passed", seconds)


# ------------------------------------------------------------------------------- reports
def table_lines(rows, catalog):
    width = max([len(m.id) for m, _ in rows] + [8])
    lines = [f"{'mutation':<{width}}  {'family':<9}  {'archs':<14}  {'verdict':<8}  {'s':>5}  note"]
    for m, v in rows:
        lines.append(f"{m.id:<{width}}  {m.family:<9}  {arch_label(m.archs, catalog):<14}  {v.status:<8}  "
                     f"{v.test_seconds:5.0f}  {v.note}")
    return lines


def score_line(rows):
    count = lambda status: sum(v.status == status for _, v in rows)
    by = lambda word: sum(v.status == "killed" and word in v.note for _, v in rows)
    return (f"score: {count('killed')}/{len(rows)} killed ({by('crash')} by a crash, {by('timeout')} by a "
            f"timeout), {count('survived')} survived, {count('error')} errors, {count('not run')} not run")


def markdown(rows, catalog, header):
    cell = lambda s: str(s).replace("|", "\\|")
    lines = ["### Mutation check (`scripts/mutate`)", "", *header, "", score_line(rows), "",
             "| mutation | family | archs | file:line | change | verdict | test s | killed by / note |",
             "| --- | --- | --- | --- | --- | --- | ---: | --- |"]
    for m, v in rows:
        where = f"{m.file.removeprefix('csrc/kernels/')}:{mutation_line((REPO / m.file).read_text(), m)}"
        lines.append(f"| `{m.id}` | {m.family} | {arch_label(m.archs, catalog)} | {where} | {cell(m.description)} | "
                     f"{v.status} | {v.test_seconds:.0f} | {cell(v.note)} |")
    return "\n".join(lines) + "\n"


def print_list(mutations, catalog):
    families = ", ".join(f"{f} {sum(m.family == f for m in mutations)}" for f in catalog.FAMILIES)
    archs = ", ".join(f"{a} {sum(a in m.archs for m in mutations)} ({sum(m.archs == (a,) for m in mutations)} "
                      f"only)" for a in catalog.ARCHS)
    print(f"{len(mutations)} mutations; family: {families}; arch: {archs}")
    invalid = 0
    for m in mutations:
        problems = mutation_problems(m, catalog)
        invalid += bool(problems)
        where = f"{m.file.removeprefix('csrc/kernels/')}" + (
            "" if problems else f":{mutation_line((REPO / m.file).read_text(), m)}")
        print(f"{m.id:<34} {m.family:<9} {arch_label(m.archs, catalog):<14} {where:<32} "
              f"{','.join(Path(t).stem.removeprefix('test_') for t in m.tests):<22} {m.description}")
        for problem in problems:
            print(f"    INVALID: {problem}")
    return 1 if invalid else 0


def describe_source():
    def git(*args):
        result = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    return commit + (" + uncommitted changes to csrc/ or tests/" if git("status", "--porcelain", "csrc", "tests") else "")


def gpu_name():
    if shutil.which("nvidia-smi") is None:
        return "no GPU"
    result = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return result.stdout.splitlines()[0].strip() if result.returncode == 0 and result.stdout.strip() else "no GPU"


# ------------------------------------------------------------------------------- the run
def prepare_work_dir(work):
    if work.exists():
        if any(work.iterdir()) and not (work / WORK_MARKER).exists():
            raise SystemExit(f"--work {work}: not empty and not made by scripts/mutate; refusing to clear it")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / WORK_MARKER).touch()


def available_cpus():
    """Cores this process may use: its affinity mask, capped by a cgroup v2 CPU quota (containers
    often see the host's cores but may use only the quota's)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def parse_args(argv, mutations):
    default_out = Path(os.environ.get("OUT") or "/tmp/mla_kv_out/mutate")
    p = argparse.ArgumentParser(prog="scripts/mutate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print the mutations (no build, no GPU) and exit")
    p.add_argument("--only", default="", help="comma-separated mutation ids to run (default: all)")
    p.add_argument("--jobs", type=int, default=available_cpus(), help="parallel compiles (default: cores)")
    p.add_argument("--test-jobs", type=int, default=8, help="mutants tested at once on the GPU (default 8)")
    p.add_argument("--out", type=Path, default=default_out, help=f"logs and tables (default {default_out})")
    p.add_argument("--work", type=Path, default=Path("/tmp/mla_kv_mutate"), help="build directory (cleared)")
    p.add_argument("--archs", default="90", help="MLA_KV_CUDA_ARCHS of the builds (default 90)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a mutant's tests may run (default: 3 x the baseline's time for its files + 60)")
    p.add_argument("--deadline", type=float, default=540,
                   help="seconds for the whole run; unfinished mutants are then 'not run' (default 540)")
    p.add_argument("--build-only", action="store_true",
                   help="build the baseline and the mutants, run no tests (a compile check without a GPU)")
    args = p.parse_args(argv)
    known = {m.id for m in mutations}
    only = [i for i in args.only.split(",") if i]
    unknown = [i for i in only if i not in known]
    if unknown:
        p.error(f"--only: unknown mutation ids {unknown}")
    if args.jobs < 1 or args.test_jobs < 1:
        p.error("--jobs and --test-jobs must be >= 1")
    args.selected = [m for m in mutations if not only or m.id in only]
    return args


def main(argv=None):
    start = time.monotonic()
    catalog = load_mutations_module()
    args = parse_args(argv, catalog.MUTATIONS)
    if args.list:
        return print_list(args.selected, catalog)
    invalid = {m.id: mutation_problems(m, catalog) for m in args.selected}
    invalid = {k: v for k, v in invalid.items() if v}
    if invalid:
        for mid, problems in invalid.items():
            print(f"invalid mutation {mid}: {'; '.join(problems)}", file=sys.stderr)
        return 2

    out, work = args.out.resolve(), args.work.resolve()
    logs = out / "mutate-logs"  # this run's only: logs are appended to, so an earlier run's go first
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    prepare_work_dir(work)
    runner = Runner(start + args.deadline)
    printing = threading.Lock()

    def say(msg):
        with printing:
            print(f"[{time.monotonic() - start:4.0f} s] {msg}", flush=True)

    base_src, base_build = work / "base" / "src", work / "base" / "build"
    for part in ("csrc", "python", "cmake"):  # (cmake: the ptxas launcher the build's commands call)
        shutil.copytree(REPO / part, base_src / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "CMakeLists.txt", base_src / "CMakeLists.txt")
    try:
        module = build_baseline(runner, base_src, base_build, args.archs, args.jobs, logs / "baseline.build.log")
        graph = read_build_graph(base_src, base_build, module)
        base_package = make_package(work / "base" / "pkg", base_src / "python" / "mla_kv",
                                    base_build / "_build_info.py", module)
        if not args.build_only:
            check_package_imported(runner, base_package, logs / "baseline.import.log")
    except (BuildError, Stopped) as e:
        print(f"scripts/mutate: {e or 'stopped at the deadline'}", file=sys.stderr)
        return 2
    build_end = time.monotonic()
    say(f"baseline built ({build_end - start:.0f} s, {len(graph.objects)} objects)")

    # Cheap builds first: their tests start while the many-object mutants still compile.
    mutants = sorted(args.selected, key=lambda m: len(graph.affected_objects(m.file)))
    files = list(dict.fromkeys(f for m in mutants for f in m.tests))
    baseline_seconds, baseline_failures = {}, []

    def run_baseline_file(f):
        log_path = logs / f"baseline.{Path(f).stem}.log"
        try:
            outcome = runner.run(pytest_command([f]), cwd=base_package, env=test_env(base_package), log_path=log_path)
        except Stopped:
            return
        baseline_seconds[f] = outcome.seconds
        say(f"baseline {f}: {'passed' if outcome.rc == 0 else f'FAILED (exit {outcome.rc})'} in {outcome.seconds:.0f} s")
        if outcome.rc != 0:
            baseline_failures.append(f"{f}: exit {outcome.rc}, first failure {first_failure(log_path) or '-'} "
                                     f"(log: {log_path})")
            runner.abort()

    def test_limit(m):
        def limit():
            if args.timeout is not None:
                return args.timeout
            if not all(f in baseline_seconds for f in m.tests):
                return None
            return 3 * sum(baseline_seconds[f] for f in m.tests) + 60
        return limit

    pool = PriorityPool(args.jobs)
    test_slots = threading.Semaphore(args.test_jobs)

    def process(order, m):
        try:
            return build_and_test(order, m)
        except Exception as e:  # one mutant's unexpected failure must not cost the others' verdicts
            say(f"error    {m.id}: {e!r}")
            return Verdict("error", repr(e)[:200])

    def build_and_test(order, m):
        mutant_dir = work / "mutants" / m.id
        t0 = time.monotonic()
        try:
            module_path, objects = build_mutant(m, graph, mutant_dir, pool, order, runner)
        except BuildError as e:
            (logs / f"{m.id}.build.log").write_text(str(e))
            say(f"error    {m.id}: build failed (log: mutate-logs/{m.id}.build.log)")
            return Verdict("error", f"build failed (mutate-logs/{m.id}.build.log)")
        except Stopped:
            return Verdict("not run", "stopped before its build finished")
        build_seconds = time.monotonic() - t0
        if args.build_only:
            say(f"built    {m.id} ({objects} objects, {build_seconds:.0f} s)")
            return Verdict("built", f"{objects} objects", 0.0, build_seconds, objects)
        package = make_package(mutant_dir / "pkg", base_src / "python" / "mla_kv", base_build / "_build_info.py",
                               module_path)
        with test_slots:
            try:
                verdict = run_kill_tests(m, package, runner, logs / f"{m.id}.test.log", test_limit(m))
            except Stopped:
                return Verdict("not run", "stopped before its tests finished", 0.0, build_seconds, objects)
        verdict.build_seconds, verdict.objects = build_seconds, objects
        say(f"{verdict.status:<8} {m.id} ({verdict.test_seconds:.0f} s) {verdict.note}")
        return verdict

    baseline_threads = [] if args.build_only else [threading.Thread(target=run_baseline_file, args=(f,)) for f in files]
    for thread in baseline_threads:
        thread.start()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(mutants)) as executor:
        verdicts = dict(zip([m.id for m in mutants], executor.map(process, range(len(mutants)), mutants)))
    for thread in baseline_threads:
        thread.join()

    if baseline_failures:
        print("scripts/mutate: the unmutated baseline fails its tests; no verdicts:", file=sys.stderr)
        for failure in baseline_failures:
            print(f"  {failure}", file=sys.stderr)
        return 2
    rows = [(m, verdicts[m.id]) for m in args.selected]
    unverified = [f for f in files if f not in baseline_seconds and not args.build_only]
    wall = time.monotonic() - start
    header = [f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {describe_source()}, "
              f"{gpu_name()}, archs {args.archs}; {len(rows)} mutants in {wall:.0f} s (baseline build "
              f"{build_end - start:.0f} s, {args.jobs} compile jobs, {args.test_jobs} test jobs).",
              "Baseline tests: " + (", ".join(f"{f} {s:.0f} s" for f, s in baseline_seconds.items()) or "not run")
              + "." + (f" UNFINISHED at the deadline: {', '.join(unverified)}; the verdicts are unverified."
                       if unverified else "")]
    table = table_lines(rows, catalog) + [score_line(rows)]
    print("\n".join(table))
    (out / "mutate.txt").write_text("\n".join(header + [""] + table) + "\n")
    (out / "mutate.md").write_text(markdown(rows, catalog, header))
    print(f"wall {wall:.0f} s; logs and tables in {out}")
    if unverified:
        print(f"scripts/mutate: the baseline did not finish {', '.join(unverified)}", file=sys.stderr)
        return 2
    wanted = "built" if args.build_only else "killed"
    return 0 if all(v.status == wanted for _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
