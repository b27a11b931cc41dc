"""Layering: ``attnzoo/kernels/`` and ``attnzoo/backends/`` are used from outside only through their public names.

A module of the package outside those two may not import a name with a leading underscore from them, nor one of
their private modules (``attnzoo.backends._tiles``), nor reach a private attribute that they (or the ``Backend``
base class, whose helpers they call) define: ``backend._validate(...)``, ``ctx._running``.  What it needs gets a
public name.  Read from the source with ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attnzoo"
INNER = ("kernels", "backends")
# The hooks every backend implements (CONTRIBUTING.md, "Adding a backend"): the subclass interface of Backend. The
# benchmark reads which class's _forward a backend runs, to know which impls share one forward kernel.
SUBCLASS_HOOKS = frozenset({"_forward", "_backward"})


# Known offenders, each to be fixed by a change in flight; the test of each is a strict xfail, so that it fails as
# soon as the module is clean and the entry must go.
def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _violations_of(path: str) -> list[str]:
    """``layering_violations`` of the module at ``path`` (relative to the package)."""
    file = PACKAGE / path
    parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    module = ".".join(parts[:-1] if is_package else parts)
    return layering_violations(file.read_text(), module, is_package)


def _is_inner_module(module: str) -> bool:
    parts = module.split(".")
    return len(parts) >= 2 and parts[0] == "attnzoo" and parts[1] in INNER


def _private_names() -> frozenset[str]:
    """Every private name defined in kernels/ and backends/ (functions, classes, module and class attributes,
    instance attributes), and the private methods of the ``Backend`` base class other than the hooks."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] not in INNER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    base = ast.parse((PACKAGE / "backend.py").read_text())
    backend_class = next(n for n in base.body if isinstance(n, ast.ClassDef) and n.name == "Backend")
    names.update(n.name for n in backend_class.body if isinstance(n, ast.FunctionDef))
    return frozenset(n for n in names if _is_private(n)) - SUBCLASS_HOOKS


PRIVATE_NAMES = _private_names()


def layering_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Where ``source`` (the text of module ``module``, e.g. ``attnzoo.debug``; ``is_package``: an ``__init__.py``)
    uses a private name of kernels/ or backends/: one line per use, with the line number."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if not _is_inner_module(target):
                continue
            if any(_is_private(part) for part in target.split(".")):
                found.append(f"line {node.lineno}: imports from private module {target}")
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"line {node.lineno}: imports {alias.name} from {target}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_inner_module(alias.name) and any(_is_private(p) for p in alias.name.split(".")):
                    found.append(f"line {node.lineno}: imports private module {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue  # a class using its own members
            found.append(f"line {node.lineno}: reaches {ast.unparse(node)}")
    return found


OUTSIDE = sorted(
    str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] not in INNER
)


@pytest.mark.parametrize("path", OUTSIDE)
def test_module_uses_only_public_names_of_kernels_and_backends(path):
    assert _violations_of(path) == []


def test_the_check_sees_each_kind_of_reach_into_the_internals():
    source = "\n".join(
        [
            "import attnzoo.backends._tiles",
            "from attnzoo.backends._tiles import tile_is_empty",
            "from ..backends import _tiles",
            "from ..kernels.launch import _launched",
            "problem = backend._validate(q, k, v, False, None, None)",
            "print(launch._placeholder)",
        ]
    )
    found = layering_violations(source, "attnzoo.bench.impls")
    assert [line.split(":")[0] for line in found] == [f"line {i}" for i in range(1, 7)], found
    clean = "\n".join(
        [
            "from attnzoo.backends import tile_is_empty",
            "from .kernels.tuning import AUTOTUNER",
            "from ._private_helper_of_bench import thing",  # attnzoo.bench's own private module: not ours to police
            "self._check(problem)",
            "torch._dynamo.config.cache_size_limit = 1024",
            "type(backend)._forward",  # the subclass hook
        ]
    )
    assert layering_violations(clean, "attnzoo.bench.impls") == []
    # Relative imports resolve from the importing module's package: the top-level __init__ reaches backends/ as ".".
    assert layering_violations("from .backends import _tiles", "attnzoo", is_package=True)
    assert not layering_violations("from .backends import _tiles", "attnzoo.bench", is_package=True)
