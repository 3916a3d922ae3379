"""Library vs applications, checked statically: every module under src/zerodp is parsed with
``ast`` (none is imported), so an import inside a function counts as much as one at the top.

(a) No module outside ``zerodp.apps`` imports ``zerodp.apps``.
(b) Inside ``zerodp.apps``, every import of the library is of a name in the ``__all__`` of a
    module listed in ``zerodp.apps.PUBLIC_API`` (see that package's docstring for the rule).
(c) No import cycle among the library's modules, counting every import (also those under
    ``TYPE_CHECKING`` and inside functions: a cycle deferred is still two modules that each need
    the other). ``from pkg import sub`` of a submodule is an import of ``sub`` (loading a
    submodule loads its package first anyway).
(d) The plan is pure data: ``zerodp.plan`` imports only ``zerodp.config`` of the library.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
APPS = "zerodp.apps"
ALWAYS_PUBLIC = {"__version__"}  # besides __all__: zerodp.__version__
FIX_LIBRARY = (
    "the library must not depend on its applications: move what both need into the library "
    "(exported from a public module), or move this code into zerodp.apps"
)
FIX_APPS = (
    "applications use only the public API (zerodp.apps.PUBLIC_API). Import it from one of those "
    "modules; if users need it too, export it there (add it to that module's __all__), "
    "otherwise the application must do without it"
)


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement (or ``importlib.import_module("...")`` call) of one module."""

    path: Path
    line: int
    module: str  # absolute, relative imports resolved
    names: tuple[str, ...] = ()  # for ``from module import a, b``; empty for ``import module``


# -- reading the sources ------------------------------------------------------------------------


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, src: Path = SRC) -> bool:
    """Whether ``name`` is a module or package under ``src``."""
    base = src.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(source: str, name: str, is_package: bool, path: Path) -> Iterator[Import]:
    """Every import in ``source`` (module ``name``), wherever it sits in the file."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            yield Import(path, node.lineno, module, tuple(a.name for a in node.names))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            yield Import(path, node.lineno, node.args[0].value)


def _is_dynamic_import(node: ast.Call) -> bool:
    """``importlib.import_module("literal")`` or ``__import__("literal")``."""
    if not node.args:
        return False
    arg = node.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id in ("import_module", "__import__")
    )


def attribute_uses(source: str, path: Path) -> Iterator[Import]:
    """``zerodp.X`` attribute reads in a module that did ``import zerodp``: an import of X."""
    tree = ast.parse(source, str(path))
    plain = any(
        isinstance(n, ast.Import) and any(a.name == "zerodp" and a.asname is None for a in n.names)
        for n in ast.walk(tree)
    )
    if not plain:
        return
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "zerodp"
        ):
            yield Import(path, node.lineno, "zerodp", (node.attr,))


def targets(imp: Import, src: Path = SRC) -> list[str]:
    """The modules an import loads: ``from pkg import sub`` loads ``pkg.sub`` as well."""
    return [imp.module] + [
        f"{imp.module}.{n}" for n in imp.names if is_module(f"{imp.module}.{n}", src)
    ]


def literal(path: Path, variable: str) -> object:
    """The value of a top-level ``variable = <literal>`` in ``path``."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == variable for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise LookupError(f"{path} has no literal {variable}")


def module_path(name: str, src: Path = SRC) -> Path:
    base = src.joinpath(*name.split("."))
    package = base / "__init__.py"
    return package if package.is_file() else base.with_suffix(".py")


def public_api(src: Path = SRC) -> dict[str, set[str]]:
    """Public module -> the names it exports (its ``__all__``)."""
    listed = literal(module_path(APPS, src), "PUBLIC_API")
    assert isinstance(listed, tuple)
    api = {}
    for module in listed:
        exported = literal(module_path(module, src), "__all__")
        assert isinstance(exported, list)
        api[module] = set(exported) | ALWAYS_PUBLIC
    return api


# -- the rules ----------------------------------------------------------------------------------


def _in_apps(module: str) -> bool:
    return module == APPS or module.startswith(APPS + ".")


def _in_zerodp(module: str) -> bool:
    return module == "zerodp" or module.startswith("zerodp.")


def library_violations(imps: list[Import], src: Path = SRC) -> list[str]:
    """(a): imports of ``zerodp.apps`` by a module outside it."""
    return [
        f"{_where(imp, src)} imports {target}: {FIX_LIBRARY}"
        for imp in imps
        for target in targets(imp, src)
        if _in_apps(target)
    ]


def apps_violations(imps: list[Import], public: dict[str, set[str]], src: Path = SRC) -> list[str]:
    """(b): imports of the library by an application that are not of its public API."""
    found = []
    for imp in imps:
        if not _in_zerodp(imp.module) or _in_apps(imp.module):
            continue
        exported = public.get(imp.module)
        if exported is None:
            found.append(f"{_where(imp, src)} imports {imp.module}: {FIX_APPS}")
            continue
        for name in imp.names:
            sub = f"{imp.module}.{name}"
            if name not in exported and sub not in public and not _in_apps(sub):
                found.append(f"{_where(imp, src)} imports {sub}, not in its __all__: {FIX_APPS}")
    return found


def _where(imp: Import, src: Path) -> str:
    return f"{imp.path.relative_to(src.parent)}:{imp.line}"


def _all_imports(path: Path, src: Path = SRC) -> list[Import]:
    source = path.read_text(encoding="utf-8")
    name = module_name(path, src)
    found = list(imports(source, name, path.name == "__init__.py", path))
    return found + list(attribute_uses(source, path))


def _modules(src: Path = SRC) -> list[Path]:
    return sorted((src / "zerodp").rglob("*.py"))


# -- the tree as it is --------------------------------------------------------------------------


def test_the_library_does_not_import_the_applications() -> None:
    library = [p for p in _modules() if not _in_apps(module_name(p))]
    assert len(library) > 50  # the walk found the library
    found = [v for p in library for v in library_violations(_all_imports(p))]
    assert not found, "\n".join(found)


def test_the_applications_use_only_the_public_api() -> None:
    apps = [p for p in _modules() if _in_apps(module_name(p))]
    assert len(apps) > 30  # the walk found the applications
    public = public_api()
    found = [v for p in apps for v in apps_violations(_all_imports(p), public)]
    assert not found, "\n".join(found)


def test_every_public_module_exports_an_explicit_list() -> None:
    api = public_api()
    assert "zerodp" in api and "initialize" in api["zerodp"]
    assert all(len(names) > len(ALWAYS_PUBLIC) for names in api.values())


def import_graph(paths: list[Path], src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the library modules it imports (rule (c))."""
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = module_name(path, src)
        edges = graph.setdefault(name, set())
        for imp in _all_imports(path, src):
            subs = [f"{imp.module}.{n}" for n in imp.names if is_module(f"{imp.module}.{n}", src)]
            loaded = subs if imp.names and len(subs) == len(imp.names) else targets(imp, src)
            edges |= {t for t in loaded if _in_zerodp(t) and is_module(t, src) and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_library_has_no_import_cycles() -> None:
    library = [p for p in _modules() if not _in_apps(module_name(p))]
    graph = import_graph(library)
    assert "zerodp.plan" in graph["zerodp.engine"]  # the walk found the edges
    found = cycles(graph)
    assert not found, "import cycles (each line: modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_plan_imports_nothing_that_executes() -> None:
    graph = import_graph([module_path("zerodp.plan")])
    assert graph["zerodp.plan"] == {"zerodp.config"}


# -- the checker catches what it should (made-up sources) ---------------------------------------


def test_a_cycle_through_a_type_checking_import_is_caught(tmp_path: Path) -> None:
    pkg = tmp_path / "zerodp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from zerodp import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import zerodp.a\n"
    )
    (pkg / "c.py").write_text("from zerodp import a, b\n")  # imports both, in no cycle
    graph = import_graph(sorted(pkg.glob("*.py")), tmp_path)
    assert cycles(graph) == [["zerodp.a", "zerodp.b"]]


def _check(source: str, name: str, is_package: bool = False) -> list[str]:
    path = SRC.joinpath(*name.split(".")).with_suffix(".py")
    imps = list(imports(source, name, is_package, path)) + list(attribute_uses(source, path))
    if _in_apps(name):
        return apps_violations(imps, public_api())
    return library_violations(imps)


@pytest.mark.parametrize(
    "source",
    [
        "import zerodp.apps.models.gpt",
        "from zerodp.apps.models import gpt",
        "from zerodp import apps",
        "def f():\n    from zerodp.apps.train.loop import rank_main\n",
        "from .apps.bench import run_bench",  # relative, from zerodp/api.py
        "import importlib\nimportlib.import_module('zerodp.apps.cli.main')",
    ],
)
def test_library_importing_an_application_is_caught(source: str) -> None:
    found = _check(source, "zerodp.api")
    assert found and "src/zerodp/api.py:" in found[0] and "zerodp.apps" in found[0], found
    assert "must not depend on its applications" in found[0]


def test_relative_imports_resolve_against_the_package() -> None:
    assert _check("from ..apps import bench", "zerodp.comm.launch") != []
    assert _check("from . import launch", "zerodp.comm", is_package=True) == []
    assert _check("from ..config import ZeroConfig", "zerodp.comm.launch") == []


@pytest.mark.parametrize(
    ("source", "imported"),
    [
        ("from zerodp.optim.optimizer import ZeroOptimizer", "zerodp.optim.optimizer"),
        ("def f():\n    from zerodp.plan import DTYPES\n", "zerodp.plan"),
        ("from zerodp.comm import STEP_PHASES_TYPO", "zerodp.comm.STEP_PHASES_TYPO"),
        ("from zerodp import engine", "zerodp.engine"),
        ("import zerodp\nx = zerodp.engine", "zerodp.engine"),
        ("from ...plan import resolve", "zerodp.plan"),
    ],
)
def test_an_application_reaching_into_an_internal_is_caught(source: str, imported: str) -> None:
    found = _check(source, "zerodp.apps.train.loop")
    assert len(found) == 1 and found[0].startswith("src/zerodp/apps/train/loop.py:"), found
    assert f" imports {imported}" in found[0] and "PUBLIC_API" in found[0]


def test_an_application_may_use_the_public_api_and_other_applications() -> None:
    ok = (
        "import zerodp\nfrom zerodp import ZeroOptimizer, checkpoint\n"
        "from zerodp.comm.launch import launch_ranks, record\nfrom zerodp.memory import GB\n"
        "from zerodp.apps.models.gpt import GPT\nfrom ..data import corpus\n"
        "v = zerodp.__version__\nzerodp.initialize\n"
    )
    assert _check(ok, "zerodp.apps.train.loop") == []
