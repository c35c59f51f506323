"""Setting a module's ``forward`` on the instance, and undoing it."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

__all__ = ["replace_forward"]


def replace_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Make ``forward`` the instance's ``forward``; returns what puts back the one it had (its class's, or an
    instance forward another library set, such as accelerate's hooks)."""
    had_own = "forward" in module.__dict__
    original = module.forward
    module.forward = forward

    def restore() -> None:
        if had_own:
            module.forward = original
        else:
            del module.forward

    return restore
