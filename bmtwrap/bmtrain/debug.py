"""BMTrain's ``bmt.debug``: a key-value store a program fills while it runs and reads back later.

The values live on this process's context (:class:`bmtwrap.engine.dist.DistContext`), so the store needs
:func:`bmtwrap.init_distributed` first. Tensors are stored detached, on the CPU.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from ..engine import dist as _dist

__all__ = ["append", "clear", "extend", "get", "set"]


def _stored(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def clear(key: Optional[str] = None) -> None:
    """Forget ``key``, or every key when ``key`` is ``None``."""
    values = _dist.current().debug_values
    if key is None:
        values.clear()
    else:
        values.pop(key, None)


def set(key: str, value: Any) -> None:  # noqa: A001 - BMTrain's name
    """Store ``value`` under ``key`` (a tensor detached, on the CPU)."""
    _dist.current().debug_values[key] = _stored(value)


def get(key: str, default: Any = None) -> Any:
    """The value stored under ``key``, or ``default``."""
    return _dist.current().debug_values.get(key, default)


def append(key: str, value: Any) -> None:
    """Append ``value`` to the list under ``key`` (made empty first if absent)."""
    _dist.current().debug_values.setdefault(key, []).append(_stored(value))


def extend(key: str, values: Iterable[Any]) -> None:
    """Extend the list under ``key`` with ``values`` (made empty first if absent)."""
    _dist.current().debug_values.setdefault(key, []).extend(_stored(v) for v in values)
