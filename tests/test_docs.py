"""The documentation: every public name has a docstring, and the site builds strictly and covers them.

The site (mkdocs.yml, docs/) renders the API reference from the docstrings with mkdocstrings, so a
missing or malformed docstring is a missing or broken page. ``mkdocs build --strict`` turns every
warning into a failure: a docstring documenting a parameter the signature lacks, a role naming
something that does not exist (docs/rst_roles.py), a link to a missing page or anchor.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
import types
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Iterator, List, NamedTuple, Optional, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The public modules; bmtwrap.hf only once it exists.
PUBLIC_MODULES = ["bmtwrap", "bmtwrap.optim", "bmtwrap.lr_scheduler", "bmtwrap.loss", "bmtwrap.wrap",
                  "bmtwrap.checkpoint", "bmtwrap.hf", "bmtwrap.hf_trl", "bmtwrap.bmtrain.nn",
                  "bmtwrap.bmtrain.distributed", "bmtwrap.bmtrain.nccl", "bmtwrap.bmtrain.comm", "bmtwrap.bmtrain.utils", "bmtwrap.bmtrain.debug",
                  "bmtwrap.bmtrain.zero_context", "bmtwrap.bmtrain.compat", "bmtwrap.data"]
# Public through a return value rather than an __all__: init_distributed() returns it.
ALSO_PUBLIC = [("bmtwrap.engine.dist", "DistContext")]
BUILD_REQUIREMENTS = ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "griffe")
BUILD_TIMEOUT_S = 120


def _public_modules() -> List[types.ModuleType]:
    # import_module, not getattr: the attribute bmtwrap.wrap is the function, the package is in sys.modules.
    return [importlib.import_module(name) for name in PUBLIC_MODULES if importlib.util.find_spec(name) is not None]


def _public_names(module: types.ModuleType) -> List[str]:
    """``__all__``, or else the non-underscore names the module itself defines."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [name for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__]


def _public_objects() -> Iterator[Tuple[str, Any]]:
    """(dotted name, object) of every public name of every public module."""
    for module in _public_modules():
        yield module.__name__, module
        for name in _public_names(module):
            yield f"{module.__name__}.{name}", getattr(module, name)
    for module_name, name in ALSO_PUBLIC:
        yield f"{module_name}.{name}", getattr(importlib.import_module(module_name), name)


def _ours(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == "bmtwrap" or module.startswith("bmtwrap.")


def _doc_of(obj: Any) -> str:
    """The object's own docstring, cleaned; "" when it has none."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    doc = inspect.cleandoc(doc) if isinstance(doc, str) else ""
    if isinstance(obj, type) and doc.startswith(f"{obj.__name__}("):
        return ""  # the signature a dataclass or NamedTuple writes for itself when it has no docstring
    return doc


def _is_routine(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, staticmethod, classmethod, property))


def _undocumented_members(cls: type, qualified: str) -> Iterator[str]:
    """Public methods and properties that ``cls`` gets from a bmtwrap class, without a docstring.

    An override may take its docstring from a bmtwrap base class; not from torch's, whose
    ``forward`` or ``step`` docstrings say nothing about ours.
    """
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        definers = [klass for klass in cls.__mro__ if name in vars(klass)]
        if not definers or not _ours(definers[0]) or not _is_routine(vars(definers[0])[name]):
            continue
        if not any(_doc_of(vars(klass)[name]) for klass in definers if _ours(klass)):
            yield f"{qualified}.{name}"


def test_every_public_name_has_a_docstring() -> None:
    missing: List[str] = []
    seen: Set[int] = set()
    for qualified, obj in _public_objects():
        if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj)):
            continue
        if not _doc_of(obj):
            missing.append(qualified)
        if inspect.isclass(obj) and _ours(obj) and id(obj) not in seen:
            seen.add(id(obj))
            missing.extend(_undocumented_members(obj, qualified))
    if missing:
        pytest.fail(f"{len(missing)} public names have no docstring (write one, Google style: Args, Returns, "
                    "Raises, Example::):\n  " + "\n  ".join(missing), pytrace=False)


# --- the site ---------------------------------------------------------------------------------------


class _Build(NamedTuple):
    returncode: int
    log: str
    site: Path


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Optional[_Build]:
    """The site built once for the tests below; None when the build tools are missing."""
    if _missing_tools():
        return None
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    return _Build(done.returncode, done.stdout + done.stderr, site)


def _missing_tools() -> List[str]:
    return [name for name in BUILD_REQUIREMENTS if _find_spec(name) is None]


def _built(build: Optional[_Build]) -> _Build:
    """``build``, or a failure (not a skip) saying what to install."""
    if build is None:
        pytest.fail(f"the documentation build needs {', '.join(_missing_tools())}, which cannot be imported by "
                    f"{sys.executable}; install the test requirements (the test extra of pyproject.toml: "
                    "pip install -e '.[test]')", pytrace=False)
    return build


def _find_spec(name: str) -> Optional[Any]:
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:  # the parent package is missing
        return None


def test_site_builds_strictly(build: Optional[_Build]) -> None:
    build = _built(build)
    problems = [line for line in build.log.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    if build.returncode != 0:
        pytest.fail("mkdocs build --strict failed; every warning is an error (fix the docstring or page it names):\n  "
                    + "\n  ".join(problems or build.log.splitlines()[-30:]), pytrace=False)


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: Set[str] = set()

    def handle_starttag(self, tag: str, attrs: List[Tuple[str, Optional[str]]]) -> None:
        for key, value in attrs:
            if key == "id" and value and value.startswith("bmtwrap"):
                self.ids.add(value)


def _object_at(path: str) -> Any:
    """The run-time object a dotted path names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        if _find_spec(name) is None:
            continue
        obj: Any = importlib.import_module(name)
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def test_site_documents_every_public_name(build: Optional[_Build]) -> None:
    build = _built(build)
    if build.returncode != 0:
        pytest.skip("the site did not build (test_site_builds_strictly says why)")
    parser = _Anchors()
    for page in build.site.rglob("*.html"):
        parser.feed(page.read_text(encoding="utf-8"))
    # A name is documented at its own path, or at another path that ends in the same name and holds
    # the same object (bmtwrap.save is rendered as bmtwrap.checkpoint.save, the function bmtwrap.wrap
    # as bmtwrap.wrap.wrap). An alias under another name (CheckpointBlock = Block) needs its own entry.
    rendered: Set[Tuple[str, int]] = set()
    for anchor in parser.ids:
        obj = _object_at(anchor)
        if obj is not None:
            rendered.add((anchor.rsplit(".", 1)[-1], id(obj)))
    absent = [qualified for qualified, obj in _public_objects()
              if qualified not in parser.ids and (qualified.rsplit(".", 1)[-1], id(obj)) not in rendered]
    if absent:
        pytest.fail(f"{len(absent)} public names are not in the API reference; add them to a page under docs/api/ "
                    "(a `::: module` directive or its `members:` list):\n  " + "\n  ".join(absent), pytrace=False)
