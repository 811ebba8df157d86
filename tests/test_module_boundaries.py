"""The module boundaries of python/mla_kv, read from the source with ``ast`` (nothing is imported).

Rules:

1. A name starting with one underscore (dunders aside) belongs to the module that defines it. Another
   module may import it (``from M import _x``) or read it (``M._x``, M an mla_kv module it imported)
   only when M is itself private: its own name starts with an underscore (``_checks``, ``_compiled``,
   ``ops/_common``, ``reference/_common``). A private module exists to be shared; its underscore
   names are its package's. A helper two public modules need moves into such a module (or gets a
   public name) instead of being imported from one of them. Importing a private module as a module
   (``from . import _plot``) is allowed.
2. The compiled extension ``mla_kv._C`` is imported by one module, ``mla_kv/_compiled.py``, which
   falls back to None in a reference-only install; every other module imports ``_C`` from
   ``mla_kv._compiled``.
3. The ops (``mla_kv.ops``) do not import ``mla_kv.reference.quant``: facts about the cache formats
   (sizes, offsets, the checks of a format's arguments) live in ``mla_kv.layout``; the reference's
   quantizer is the spec of the bytes, not a source of layout facts. (The ops may call the reference
   ops themselves, through ``mla_kv.reference``.)
4. One tensor check, ``mla_kv._checks.tensor``: no other module raises its "expected a torch.Tensor"
   error itself.
5. A Python tool of scripts/ is a module, ``scripts/<tool>.py``, behind a thin executable
   ``scripts/<tool-with-dashes>`` that calls its ``main``; the tests import the module by name
   (conftest puts scripts/ on sys.path), with no importlib loader for extensionless files.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

REPO = Path(__file__).resolve().parent.parent
PACKAGE_ROOT = REPO / "python" / "mla_kv"
SCRIPTS = REPO / "scripts"
COMPILED = "mla_kv._C"
COMPILED_HOME = "mla_kv._compiled"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_files(root: Path, package: str = "mla_kv") -> Dict[str, Path]:
    """Dotted module name -> its file, for every .py file under root (a package's __init__ is the package;
    a build-time template, _build_info.py.in, stands for the module the build writes)."""
    modules = {}
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.py.in")]):
        relative = path.relative_to(root)
        parts = [package, *relative.parent.parts, relative.name.split(".")[0]]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


class _Checker(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: Set[str], package: str):
        self.module, self.modules, self.package = module, modules, package
        self.here = module if is_package else module.rpartition(".")[0]
        self.aliases: Dict[str, str] = {}  # local name -> the mla_kv module it is bound to
        self.imported: Set[str] = set()  # every mla_kv module (and _C) this module imports
        self.problems: List[str] = []

    def _ours(self, name: str) -> bool:
        return name == self.package or name.startswith(self.package + ".")

    def _is_module(self, name: str) -> bool:
        return name in self.modules or name == self.package + "._C"

    def _report(self, node: ast.AST, message: str) -> None:
        self.problems.append(f"{self.module}:{node.lineno}: {message}")

    def _use_module(self, node: ast.AST, target: str) -> None:
        self.imported.add(target)
        if target == self.package + "._C" and self.module != self.package + "._compiled":
            self._report(node, f"imports the extension {target} (only {self.package}._compiled does)")

    def _use_name(self, node: ast.AST, owner: str, name: str, how: str) -> None:
        if not _private(name):
            return
        if name == "_C":
            if owner != self.package + "._compiled":
                self._report(node, f"{how} _C from {owner} (take it from {self.package}._compiled)")
            return
        if not _private(owner.rpartition(".")[2]):
            self._report(node, f"{how} {owner}.{name}, a private name of a public module")

    def _base(self, node: ast.ImportFrom) -> Optional[str]:
        if not node.level:
            return node.module
        parts = self.here.split(".")
        if node.level - 1 >= len(parts):
            return None
        base = ".".join(parts[:len(parts) - (node.level - 1)])
        return f"{base}.{node.module}" if node.module else base

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not self._ours(alias.name):
                continue
            self._use_module(node, alias.name)
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                self.aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._base(node)
        if base is None or not self._ours(base):
            return
        self.imported.add(base)
        for alias in node.names:
            target = f"{base}.{alias.name}"
            if self._is_module(target):
                self._use_module(node, target)
                self.aliases[alias.asname or alias.name] = target
            else:
                self._use_name(node, base, alias.name, "imports")

    def _module_of(self, expr: ast.AST) -> Optional[str]:
        if isinstance(expr, ast.Name):
            return self.aliases.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self._module_of(expr.value)
            if owner is not None and self._is_module(f"{owner}.{expr.attr}"):
                return f"{owner}.{expr.attr}"
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        owner = self._module_of(node.value)
        if owner is not None:
            target = f"{owner}.{node.attr}"
            if self._is_module(target):
                self._use_module(node, target)
            else:
                self._use_name(node, owner, node.attr, "reads")
        self.generic_visit(node)


def check_tree(root: Path, package: str = "mla_kv"):
    """-> (problems, {module: the mla_kv modules it imports}) for the package whose files are under root."""
    files = module_files(root, package)
    problems: List[str] = []
    imports: Dict[str, Set[str]] = {}
    for module, path in files.items():
        checker = _Checker(module, path.name == "__init__.py", set(files), package)
        if path.suffix == ".py":
            checker.visit(ast.parse(path.read_text(), str(path)))
        problems += checker.problems
        imports[module] = checker.imported
    return problems, imports


def test_the_package_is_where_the_check_looks():
    """The check reads the real tree: the modules its rules name are there (else it would pass on nothing)."""
    modules = module_files(PACKAGE_ROOT)
    for expected in ("mla_kv", "mla_kv._checks", COMPILED_HOME, "mla_kv.layout", "mla_kv.ops", "mla_kv.ops._common",
                     "mla_kv.ops.attention", "mla_kv.ops.expanded", "mla_kv.ops.library", "mla_kv.reference.quant",
                     "mla_kv.reference._common", "mla_kv.weights", "mla_kv.parallel", "mla_kv.bench.common"):
        assert expected in modules, expected
    assert len(modules) > 30


def test_no_private_name_crosses_a_public_module():
    problems, _ = check_tree(PACKAGE_ROOT)
    assert not problems, "\n".join(problems)


def test_the_extension_is_imported_in_one_place():
    _, imports = check_tree(PACKAGE_ROOT)
    assert [m for m, used in imports.items() if COMPILED in used] == [COMPILED_HOME]
    source = module_files(PACKAGE_ROOT)[COMPILED_HOME].read_text()
    assert "except ImportError" in source  # the reference-only install's fallback


def test_ops_take_layout_facts_from_layout():
    _, imports = check_tree(PACKAGE_ROOT)
    ops = [m for m in imports if m == "mla_kv.ops" or m.startswith("mla_kv.ops.")]
    assert len(ops) >= 6
    offenders = [m for m in ops if "mla_kv.reference.quant" in imports[m]]
    assert not offenders, offenders
    assert all("mla_kv.layout" in imports[m] for m in ("mla_kv.ops._common", "mla_kv.reference.quant"))


def test_one_tensor_check():
    raising = [m for m, path in module_files(PACKAGE_ROOT).items() if "expected a torch.Tensor, got" in path.read_text()]
    assert raising == ["mla_kv._checks"]


def test_the_check_finds_violations(tmp_path):
    """Each rule, broken on purpose in a small package, is reported; the allowed forms are not."""
    pkg = tmp_path / "pkg"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "reference").mkdir()
    files = {
        "__init__.py": "from . import ops\n",
        "_compiled.py": "try:\n    from . import _C\nexcept ImportError:\n    _C = None\n",
        "_checks.py": "def _shared():\n    pass\n",
        "layout.py": "def _own():\n    pass\n",
        "ops/__init__.py": "from .._compiled import _C\n",
        "ops/_common.py": "from .._checks import _shared\n\n\ndef _helper():\n    pass\n",
        "ops/attention.py": "from .._compiled import _C\nfrom ._common import _helper\n\n\ndef _private_one():\n    pass\n",
        "ops/expanded.py": ("from .attention import _private_one\n"   # 1: a public module's private name
                            "from . import attention as _attention\n"
                            "from .. import _C\n"                       # 2: the extension itself
                            "from ._common import _C\n"                 # 2: _C not from _compiled
                            "from ..reference import quant\n"           # 3: ops reach into the quantizer
                            "x = _attention._private_one\n"             # 1: through an attribute
                            "import pkg.layout\n"
                            "y = pkg.layout._own\n"),                   # 1: through a dotted attribute
        "reference/__init__.py": "",
        "reference/quant.py": "from ..layout import _own\n",           # 1
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    problems, imports = check_tree(pkg, "pkg")
    where = sorted(p.split(":")[0] + ":" + p.split(":")[1] for p in problems)
    assert where == ["pkg.ops.expanded:1", "pkg.ops.expanded:3", "pkg.ops.expanded:4", "pkg.ops.expanded:6",
                     "pkg.ops.expanded:8", "pkg.reference.quant:1"], problems
    assert "pkg.reference.quant" in imports["pkg.ops.expanded"]
    assert [m for m, used in imports.items() if "pkg._C" in used] == ["pkg._compiled", "pkg.ops.expanded"]


def test_python_tools_are_modules_behind_thin_executables():
    wrappers = []
    for path in sorted(SCRIPTS.iterdir()):
        text = path.read_text() if path.is_file() and not path.suffix else ""
        if not text.startswith("#!") or "python" not in text.splitlines()[0]:
            continue
        wrappers.append(path.name)
        module = path.name.replace("-", "_")
        assert (SCRIPTS / f"{module}.py").is_file(), path.name
        calls = [(n.module, [a.name for a in n.names]) for n in ast.walk(ast.parse(text))
                 if isinstance(n, ast.ImportFrom)]
        assert calls == [(module, ["main"])], path.name
        assert len([line for line in text.splitlines() if line.strip()]) <= 10, path.name
    assert {"check-sm70", "issue-floor", "mutate", "smem-report"} <= set(wrappers)


def test_tests_import_the_tools_without_loaders():
    for path in sorted(REPO.joinpath("tests").glob("*.py")):
        if path.name != Path(__file__).name:
            text = path.read_text()
            assert "SourceFileLoader" not in text and "spec_from_loader" not in text, path.name
