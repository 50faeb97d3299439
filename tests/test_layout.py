"""The package's layout: layers as folders, no import circles, no module over 700 lines."""

from __future__ import annotations

import ast
import contextlib
import textwrap
from pathlib import Path

import asyncomm

PACKAGE = Path(asyncomm.__file__).resolve().parent
ROOT = PACKAGE.parent
MAX_LINES = 700
# Each layer imports only from the layers before it (and the standard library, torch...).
LAYERS = ["_core", "_backends", "_messaging", "_observe", "_comm", "_overlap",
          "pipeline", "_runtime", "trace", "_tools", "testing"]


def _module_file(name: str) -> Path | None:
    """Return the file of module ``name`` if it is one of the package's, else None."""
    if name != "asyncomm" and not name.startswith("asyncomm."):
        return None
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imports_of(path: Path) -> set[Path]:
    """Return the package's files that ``path`` imports, anywhere in it (type-only too)."""
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import name``: the submodule pkg/name if it is one, else pkg itself
            names = [f"{node.module}.{alias.name}" if _module_file(f"{node.module}.{alias.name}")
                     else node.module for alias in node.names]
        else:
            continue
        found.update(f for name in names if (f := _module_file(name)) is not None)
    found.discard(path)
    return found


def graph() -> dict[Path, set[Path]]:
    return {path: imports_of(path) for path in sorted(PACKAGE.rglob("*.py"))}


def cycles(edges: dict[Path, set[Path]]) -> list[list[Path]]:
    """Return the strongly connected components of more than one file (Tarjan)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    found: list[list[Path]] = []

    def visit(node: Path) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in edges:
        if node not in index:
            visit(node)
    return found


def _layer(path: Path) -> str | None:
    first = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    return first if first in LAYERS else None


def test_no_import_circles() -> None:
    circles = cycles(graph())
    assert not circles, "import circles: " + "; ".join(
        " -> ".join(str(p.relative_to(ROOT)) for p in circle) for circle in circles)


def test_layers_import_only_downward() -> None:
    upward = []
    for path, imported in graph().items():
        mine = _layer(path)
        if mine is None:
            continue
        for other in imported:
            theirs = _layer(other)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                upward.append(f"{path.relative_to(ROOT)} -> {other.relative_to(ROOT)}")
    assert not upward, "imports up the layers: " + "; ".join(upward)


def test_the_graph_sees_a_circle() -> None:
    a, b, c = Path("a.py"), Path("b.py"), Path("c.py")
    assert cycles({a: {b}, b: {c}, c: {a}}) == [[c, b, a]]
    assert cycles({a: {b}, b: {c}, c: set()}) == []


SOURCES = ("*.py", "*.pyx", "*.pxd", "*.c", "*.cc", "*.cpp", "*.h", "*.hpp")
MAX_PACKAGE_LINES = 19_450  # the whole package, every source it ships (compiled ones too)


def _sources() -> list[Path]:
    return [p for pattern in SOURCES for p in PACKAGE.rglob(pattern)]


def test_no_module_is_too_long() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_package_stays_small() -> None:
    total = sum(len(p.read_text().splitlines()) for p in _sources())
    assert total <= MAX_PACKAGE_LINES, f"the package is {total} lines"


def test_backends_alone_import_the_engines() -> None:
    engines = ("torch.distributed", "mpi4py")
    outside = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in ("_backends", "_tools"):
            continue  # the backends; and the tools' raw baselines and launcher
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == e or n.startswith(e + ".") for n in names for e in engines):
                outside.append(str(path.relative_to(ROOT)))
    assert not outside, f"torch.distributed or mpi4py imported outside the backends: {outside}"


# What a behaviour test may read of objects that are not asyncomm's (the standard library's
# and torch's own underscored names), and of the test's own classes (``self``).
NOT_ASYNCOMMS = {"self", "os", "sys", "torch", "np", "asyncio", "threading", "signal", "socket"}


def _private_name(name: str) -> bool:
    """Whether dotted ``name`` is asyncomm's and has a private part (``asyncomm._core``,
    ``asyncomm.testing._rank``; not ``asyncomm.__main__``, the command line's)."""
    parts = name.split(".")
    return parts[0] == "asyncomm" and any(p[:1] == "_" and p[:2] != "__" for p in parts[1:])


def private_reaches(source: str) -> list[str]:
    """Return where ``source`` reaches past asyncomm's public API: a private module or name
    imported, or an underscored attribute read; in the scripts it holds as strings too."""
    reaches = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            reaches += [f"line {node.lineno}: {n}" for n in names if _private_name(n)]
        elif isinstance(node, ast.Import):
            reaches += [f"line {node.lineno}: {a.name}" for a in node.names
                        if _private_name(a.name)]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") \
                and not (isinstance(node.value, ast.Name) and node.value.id in NOT_ASYNCOMMS):
            reaches.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and "asyncomm" in node.value:
            with contextlib.suppress(SyntaxError):  # (text, not a script)
                script = private_reaches(textwrap.dedent(node.value))
                reaches += [f"line {node.lineno}, script {r}" for r in script]
    return reaches


def test_behaviour_tests_use_the_public_api() -> None:
    # A test in tests/ is a user's: it passes as long as the documented behaviour holds, so
    # the insides can change under it. A test that reaches in on purpose lives in
    # tests/internals/ and says why in its docstring.
    reaching = {path.name: found for path in sorted((ROOT / "tests").glob("*.py"))
                if path.name != "test_layout.py"  # (this file names private modules as data)
                and (found := private_reaches(path.read_text()))}
    assert not reaching, reaching


def test_private_reaches_are_seen() -> None:
    source = textwrap.dedent('''
        from asyncomm._core import wire
        from asyncomm import Comm, _runtime
        import asyncomm.testing._rank
        from asyncomm.__main__ import main
        comm._router.link
        self._x
        SCRIPT = """
        import asyncomm
        asyncomm._runtime.run_loop(main())
        """
    ''')
    assert sorted(private_reaches(source)) == [
        "line 2: asyncomm._core", "line 2: asyncomm._core.wire", "line 3: asyncomm._runtime",
        "line 4: asyncomm.testing._rank", "line 6: ._router",
        "line 8, script line 3: ._runtime"]
