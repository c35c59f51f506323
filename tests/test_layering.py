"""The package's architecture, checked: which folder may import which, and no module over 600 lines.

Imports flow one way (``bmtwrap/__init__.py`` draws it): ops <- engine <- bmtrain <- wrap <- optim /
checkpoint <- the front ends. Every ``import`` and ``from ... import`` counts, those inside functions too,
read from the source with ``ast`` (nothing is imported).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "bmtwrap"
MAX_LINES = 600

# What each part of the package may import from bmtwrap, besides itself. The top level's __init__, the
# CLI and the Trainer are the outermost front ends and may import anything.
ALLOWED: Dict[str, FrozenSet[str]] = {
    "_C": frozenset(),
    "ops": frozenset({"_C"}),
    "engine": frozenset({"ops"}),
    "bmtrain": frozenset({"engine", "ops"}),
    "wrap": frozenset({"engine", "ops", "loss"}),
    "optim": frozenset({"engine", "ops"}),
    "loss": frozenset({"engine", "ops"}),
    "lr_scheduler": frozenset({"engine", "ops"}),
    "checkpoint": frozenset({"engine", "ops", "wrap", "optim"}),
    "data": frozenset(),  # reading and tokenizing training data: nothing of the engine
}


def part_of(module: str) -> str:
    """``bmtwrap.engine.group`` -> ``engine``; ``bmtwrap.hf`` -> ``hf``; ``bmtwrap`` -> ``bmtwrap``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path) -> Tuple[str, str]:
    """The module a file defines, and the package its relative imports start from."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        name = ".".join(parts[:-1])
        return name, name
    name = ".".join(parts)
    return name, name.rpartition(".")[0]


def imported(source: str, package: str) -> Iterator[Tuple[int, str]]:
    """(line, module) for every bmtwrap module the source imports."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "bmtwrap":
                continue
            # `from . import x`: x may be a module of its own.
            targets = [target] if node.module else [f"{target}.{alias.name}" for alias in node.names]
            for name in targets:
                yield node.lineno, name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "bmtwrap":
                    yield node.lineno, alias.name


def violations(module: str, package: str, source: str) -> List[str]:
    """Each import of ``module``'s source that its part may not make."""
    mine = part_of(module)
    allowed = ALLOWED.get(mine)
    if allowed is None:  # a front end at the top
        return []
    found = []
    for line, target in imported(source, package):
        theirs = part_of(target)
        if target != "bmtwrap" and theirs != mine and theirs not in allowed:
            found.append(f"{module}:{line} imports {target} ({mine} may import {sorted(allowed) or 'nothing'})")
        elif target == "bmtwrap":
            found.append(f"{module}:{line} imports the whole package")
    return found


def sources() -> Iterator[Tuple[Path, str, str, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        module, package = module_name(path)
        yield path, module, package, path.read_text()


def test_the_package_has_the_parts_the_table_names() -> None:
    parts = {part_of(module) for _, module, _, _ in sources()}
    assert {"engine", "bmtrain", "wrap", "optim", "checkpoint", "ops"} <= parts, parts


def test_imports_flow_one_way() -> None:
    found = [v for _, module, package, source in sources() for v in violations(module, package, source)]
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_no_module_over_600_lines() -> None:
    long = [f"{path.relative_to(PACKAGE.parent)}: {len(source.splitlines())} lines"
            for path, _, _, source in sources() if len(source.splitlines()) > MAX_LINES]
    assert not long, f"split these by concern (at most {MAX_LINES} lines each):\n" + "\n".join(long)


@pytest.mark.parametrize("module, package, source, expected", [
    ("bmtwrap.engine.group", "bmtwrap.engine", "from ..wrap.convert import wrap\n", "imports bmtwrap.wrap.convert"),
    ("bmtwrap.engine.group", "bmtwrap.engine", "def f():\n    from ..bmtrain import block\n",
     "imports bmtwrap.bmtrain "),
    ("bmtwrap.engine.group", "bmtwrap.engine", "import bmtwrap.optim\n", "imports bmtwrap.optim"),
    ("bmtwrap.wrap.auto", "bmtwrap.wrap", "from ..bmtrain.block import Block\n", "imports bmtwrap.bmtrain.block"),
    ("bmtwrap.bmtrain.block", "bmtwrap.bmtrain", "from .. import hf\n", "imports bmtwrap.hf"),
    ("bmtwrap.optim.adam", "bmtwrap.optim", "import bmtwrap as bmt\n", "imports the whole package"),
])
def test_the_check_finds_what_it_should(module: str, package: str, source: str, expected: str) -> None:
    found = violations(module, package, source)
    assert len(found) == 1 and expected in found[0], found


def test_the_check_lets_the_allowed_through() -> None:
    assert violations("bmtwrap.engine.group", "bmtwrap.engine", "from .dist import x\nfrom ..ops import y\n") == []
    assert violations("bmtwrap.checkpoint.full", "bmtwrap.checkpoint", "from ..wrap import z\n") == []
    assert violations("bmtwrap.hf", "bmtwrap", "from .checkpoint import a\nfrom .bmtrain import b\n") == []


def test_the_old_module_paths_still_import() -> None:
    import importlib

    import bmtwrap
    assert "bmtwrap.compat" in bmtwrap.MOVED_MODULES and "bmtwrap.dist" in bmtwrap.MOVED_MODULES
    for old, new in bmtwrap.MOVED_MODULES.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from bmtwrap.compat import install_bmtrain_alias
    from bmtwrap.nn import Linear
    assert install_bmtrain_alias.__module__ == "bmtwrap.bmtrain.compat" and Linear is bmtwrap.bmtrain.nn.Linear
