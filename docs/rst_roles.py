"""Griffe extension: render bmtwrap's reStructuredText docstring idioms as Markdown, at build time only.

The docstrings are written for ``help()`` and for readers of the source, in Google style with the
reST idioms Python programmers know: ``:func:`wrap` ``, ``:class:`~bmtwrap.optim.AdamOptimizer` ``,
``:meth:`state_dict` `` and ``Example::`` followed by an indented block. mkdocstrings renders
Markdown, so this extension rewrites each docstring's text after griffe has loaded the package and
before it is parsed:

- a role becomes a cross-reference to its target, resolved by griffe in the scope of the object
  that holds the docstring (so ``:func:`wrap` `` in ``bmtwrap.wrap.convert`` means that module's
  ``wrap``). ``~`` keeps only the last component of the title; functions and methods get ``()``.
  The link is optional: a target the site does not render (an internal module, say) reads as
  code. Coverage of the public names is checked by tests/test_docs.py instead.
- a role naming something in bmtwrap that griffe cannot find (a typo, a renamed function) is a
  warning, so ``mkdocs build --strict`` fails on it. A target outside bmtwrap (``torch...``)
  is left as code: the build has no network, so it has no other inventory to link to.
- ``Example::`` (or ``Examples::``) and its indented block become a Google ``Example:`` section
  holding a fenced ``python`` block.

It also gives a class constructed by ``__new__`` alone (``DistributedParameter``) the signature of
its ``__new__``, so that its ``Args:`` section matches a signature (griffe reads ``__init__`` only).

Registered in mkdocs.yml under the python handler's ``options.extensions``.
"""

from __future__ import annotations

import html
import re
from typing import Any, Iterator, Optional

import griffe

_ROLE = re.compile(r":(?:py:)?(func|meth|class|mod|attr|data|exc|obj):`(~?)([^`<>]+?)`")
_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)(?P<title>Examples?)::[ \t]*\n(?P<body>(?:[ \t]*\n|(?P=indent)[ \t]+\S.*\n?)+)",
                      re.MULTILINE)
_CALLABLE_ROLES = ("func", "meth")
_PACKAGE = "bmtwrap"


def _lookup(root: griffe.Module, path: str) -> Optional[griffe.Object]:
    """The object at the absolute dotted ``path`` (inside ``root``'s package), or None."""
    try:
        return root[path[len(root.path) + 1 :]] if path != root.path else root
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


class _Unresolved(Exception):
    """A role names something in bmtwrap that does not exist."""


def _resolve(obj: griffe.Object, root: griffe.Module, role: str, name: str) -> Optional[str]:
    """The dotted path ``name`` means in ``obj``'s docstring; None when it is outside bmtwrap.

    Raises:
        _Unresolved: ``name`` is not a name in ``obj``'s scope, or is bmtwrap's but does not exist.
    """
    first, _, rest = name.partition(".")
    if first == root.name:
        path = name
    else:
        try:
            base = obj.resolve(first)
        except griffe.NameResolutionError as err:
            raise _Unresolved(name) from err
        path = f"{base}.{rest}" if rest else base
    if path != root.path and not path.startswith(root.path + "."):
        return None
    target = _lookup(root, path)
    if target is None:
        raise _Unresolved(name)
    if role in _CALLABLE_ROLES + ("class", "exc") and target.is_module:
        # A package that re-exports a function of a submodule's name: ``bmtwrap.wrap`` is the
        # package to griffe and the function ``wrap`` at run time (the import rebinds the
        # attribute); so is ``bmtwrap.wrap.plan``, and ``bmtwrap.plan`` that re-exports it.
        if target.is_alias:
            target = target.final_target
        parent = target.parent
        imported = parent.imports.get(target.name) if parent is not None else None
        inner = target.members.get(target.name)
        if imported is not None:
            path = imported
        elif inner is not None:
            path = inner.path
    return path


def _convert_roles(obj: griffe.Object, root: griffe.Module, text: str) -> str:
    def replace(match: re.Match) -> str:
        role, short, name = match.group(1), match.group(2), match.group(3).strip()
        title = name.rsplit(".", 1)[-1] if short else name
        if role in _CALLABLE_ROLES:
            title += "()"
        try:
            path = _resolve(obj, root, role, name)
        except _Unresolved:
            where = obj.docstring.lineno if obj.docstring is not None else obj.lineno
            griffe.logger.warning(f"{obj.relative_filepath}:{where}: {obj.path}: the docstring refers to "
                                  f":{role}:`{name}`, which is not a name in its scope")
            path = None
        if path is None:
            return f"`{title}`"
        # An optional autoref: a link where the target is rendered, plain code elsewhere.
        return f'<autoref identifier="{html.escape(path)}" optional><code>{html.escape(title)}</code></autoref>'

    return _ROLE.sub(replace, text)


def _convert_examples(text: str) -> str:
    def replace(match: re.Match) -> str:
        indent = match.group("indent")
        lines = match.group("body").rstrip("\n").split("\n")
        while lines and not lines[0].strip():
            lines.pop(0)
        code_indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
        inner = indent + "    "
        code = [inner + line[code_indent:] if line.strip() else "" for line in lines]
        return "\n".join([f"{indent}Example:", f"{inner}```python", *code, f"{inner}```", ""])

    if not text.endswith("\n"):
        text += "\n"
    return _EXAMPLE.sub(replace, text).rstrip("\n")


def _constructor_from_new(cls: griffe.Class) -> None:
    """Give a class that defines ``__new__`` but no ``__init__`` an ``__init__`` with ``__new__``'s parameters."""
    new = cls.members.get("__new__")
    if "__init__" in cls.members or new is None or new.is_alias or not new.is_function:
        return
    params = list(new.parameters)[1:]  # without cls
    this = griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)
    init = griffe.Function("__init__", lineno=new.lineno, endlineno=new.endlineno,
                           parameters=griffe.Parameters(this, *params))
    cls.set_member("__init__", init)


def _walk(obj: griffe.Object, seen: set) -> Iterator[griffe.Object]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    for member in obj.members.values():
        if member.is_alias:
            continue  # documented where it is defined; an alias shares that docstring
        yield from _walk(member, seen)


class RstRoles(griffe.Extension):
    """Rewrite the reST idioms of every docstring in the bmtwrap package as Markdown."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != _PACKAGE:
            return
        for obj in _walk(pkg, set()):
            if obj.is_class:
                _constructor_from_new(obj)
            docstring = obj.docstring
            if docstring is None:
                continue
            docstring.value = _convert_roles(obj, pkg, _convert_examples(docstring.value))
