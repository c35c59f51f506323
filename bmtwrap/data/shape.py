"""What a record holds, and under which column names.

Three shapes are recognised, in this order of preference:

- ``messages``: a conversation, a list of ``{"role": ..., "content": ...}``, rendered with a chat template;
- ``prompt`` and ``completion``: two strings, the completion following the prompt;
- ``text``: one string, a document.

Data whose columns have other names maps them with :class:`Fields`, e.g.
``Fields.parse("prompt=question,completion=answer")``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, Iterable, Tuple

from .read import DataError


class Shape(enum.Enum):
    """The kind of record; its value names the fields it reads."""

    MESSAGES = ("messages",)
    PROMPT_COMPLETION = ("prompt", "completion")
    TEXT = ("text",)

    @property
    def names(self) -> Tuple[str, ...]:
        """The fields a record of this shape holds, e.g. ``("prompt", "completion")``."""
        return self.value


NAMES = ("text", "prompt", "completion", "messages")


@dataclass(frozen=True)
class Fields:
    """Which column holds each field: ``columns["prompt"] = "question"``; a field not named is its own column."""

    columns: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> "Fields":
        """``"prompt=question,completion=answer"`` -> Fields; raises ValueError naming a malformed or unknown part."""
        columns = {}
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            name, sep, column = (s.strip() for s in part.partition("="))
            if not sep or not name or not column:
                raise ValueError(f"{part!r} is not FIELD=COLUMN (e.g. prompt=question,completion=answer)")
            if name not in NAMES:
                raise ValueError(f"{part!r}: no field {name!r}; the fields are {', '.join(NAMES)}")
            columns[name] = column
        return cls(columns)

    def column(self, name: str) -> str:
        """The column that holds the field ``name``."""
        return self.columns.get(name, name)

    def __str__(self) -> str:
        """As ``parse`` reads it; ``none`` when every field is its own column."""
        return ",".join(f"{k}={v}" for k, v in self.columns.items()) or "none"


class MissingFields(DataError):
    """No shape's columns are all present; ``found`` lists the columns the data has."""

    def __init__(self, message: str, found: Tuple[str, ...]) -> None:
        super().__init__(message)
        self.found = found


def find_shape(columns: Iterable[str], fields: Fields = Fields()) -> Shape:
    """The first shape (``Shape``'s order) whose fields are all columns of the data.

    Raises:
        MissingFields: no shape fits; its message names the columns found and the fields looked for.
    """
    columns = tuple(columns)
    for shape in Shape:
        if all(fields.column(name) in columns for name in shape.names):
            return shape
    wanted = " or ".join("+".join(repr(fields.column(n)) for n in shape.names) for shape in Shape)
    raise MissingFields(f"no column {wanted} (the columns found: {', '.join(map(repr, columns)) or 'none'})",
                        columns)
