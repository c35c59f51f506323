"""ParameterInitializer: an ``init_method`` that carries extra arguments (BMTrain's class)."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["ParameterInitializer"]


class ParameterInitializer:
    """``func`` with extra arguments bound, to pass as ``DistributedParameter(init_method=...)``.

    Like ``functools.partial``, but the tensor comes first: calling it with the full, unsharded
    tensor calls ``func(tensor, *args, **kwargs)``. :func:`bmtwrap.init_parameters` calls it with
    the full tensor on every rank, so the values equal those of ``func`` on the unsharded tensor.

    Args:
        func: an in-place initialiser taking the tensor first, e.g. ``torch.nn.init.normal_``.
        *args: positional arguments after the tensor.
        **kwargs: keyword arguments.

    Raises:
        TypeError: ``func`` is not callable.

    Example::

        init = bmt.ParameterInitializer(torch.nn.init.normal_, mean=0.0, std=0.02)
        self.weight = bmt.DistributedParameter(torch.empty(out_f, in_f), init_method=init)
    """

    def __init__(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if not callable(func):
            raise TypeError(f"ParameterInitializer expects a callable func, got {type(func).__name__}")
        self.func = func
        self.args = args
        self.kwargs = kwargs

    def __call__(self, tensor: torch.Tensor) -> None:
        """Initialise ``tensor`` (the full tensor) in place: ``func(tensor, *args, **kwargs)``."""
        self.func(tensor, *self.args, **self.kwargs)

    def __repr__(self) -> str:
        name = getattr(self.func, "__qualname__", repr(self.func))
        return f"ParameterInitializer({name}, args={self.args!r}, kwargs={self.kwargs!r})"
