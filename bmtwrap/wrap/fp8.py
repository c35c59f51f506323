"""Float8 blocks: ``wrap(fp8=...)``.

[Note: float8 blocks]
With ``fp8`` on, the linear layers inside the blocks compute their three matrix products (the
output, the input's gradient and the weight's gradient) in float8, through torchao's float8
training (``torchao.float8.convert_to_float8_training``): each ``nn.Linear`` becomes torchao's
``Float8Linear``, which casts its input, weight and output gradient to float8 with scales computed
from their current maximum (dynamic scaling) and multiplies them with ``torch._scaled_mm``.
Everything else stays as it was: the weights, their gradients and the optimizer keep the model's
dtype (the master copy in bf16 or fp32, never float8), the norms, the embeddings and the output
projection (all in the root group, outside the blocks) compute in the model's dtype, and a
checkpoint holds the same tensors as without fp8.

``Float8Linear`` keeps the ``nn.Linear``'s parameter objects, so the conversion runs before
sharding and the engine shards, gathers and reduces those parameters as any others. Each block's
forward sees its full gathered weight, so a tensorwise scale is that of the whole weight, the same
on every rank, and needs no communication (the weight is gathered in the model's dtype and cast
after the gather; casting each shard before a float8 gather would halve the gathered bytes, at the
price of a collective for the scale).

Only linears whose two dimensions are multiples of 16 convert (float8 matrix products need it);
the others stay in the model's dtype. Float8 needs a GPU with float8 tensor cores (compute
capability 8.9 or more: Ada, Hopper, Blackwell); elsewhere ``fp8`` is refused, except with a
``Float8LinearConfig(emulate=True)``, torchao's emulation (float8 rounding, high-precision
products), which runs anywhere and is how the CPU tests check the conversion. The casts are cheap
only when compiled: the blocks' default ``compile="auto"`` fuses them into the layer's kernels.

Recipes (torchao's): ``"tensorwise"`` (``fp8=True``; one scale per tensor, the fastest),
``"rowwise"`` (one scale per row, more accurate under outliers, slower), ``"rowwise_with_gw_hp"``
(rowwise, with the weight's gradient in high precision).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

__all__ = ["FP8_RECIPES", "Float8Choice", "check_device", "convert_blocks", "describe", "float8_choice", "float8_linears"]

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

FP8Option = Union[bool, str, Any]  # True, False, a recipe name, or a torchao Float8LinearConfig


@dataclasses.dataclass(frozen=True)
class Float8Choice:
    """What ``fp8`` asked for: the recipe's name (or ``"config"`` for a config given as it is) and torchao's config."""

    recipe: str
    config: Any  # torchao.float8.Float8LinearConfig

    @property
    def compared(self) -> Any:
        """A value that is equal for two ``wrap`` calls asking for the same float8 compute."""
        return self.recipe if self.recipe != "config" else self.config


def _torchao() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise ImportError("wrap(fp8=...) needs torchao's float8 training: pip install 'bmtwrap[fp8]' "
                          "(or pip install torchao)") from error
    return float8


def float8_choice(fp8: FP8Option) -> Optional[Float8Choice]:
    """``fp8`` checked and resolved to torchao's config; ``None`` when it is off. Device-independent (the plan uses it)."""
    if fp8 is False or fp8 is None:
        return None
    if fp8 is True:
        fp8 = "tensorwise"
    if isinstance(fp8, str):
        if fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8={fp8!r} is not a float8 recipe; give True (tensorwise), one of "
                             f"{', '.join(map(repr, FP8_RECIPES))}, a torchao Float8LinearConfig, or False")
        return Float8Choice(fp8, _torchao().Float8LinearConfig.from_recipe_name(fp8))
    float8 = _torchao()
    if not isinstance(fp8, float8.Float8LinearConfig):
        raise TypeError(f"fp8 must be True, False, a recipe name ({', '.join(FP8_RECIPES)}) or a torchao "
                        f"Float8LinearConfig, got {type(fp8).__name__}")
    if fp8.enable_fsdp_float8_all_gather:
        raise ValueError("fp8: Float8LinearConfig(enable_fsdp_float8_all_gather=True) is for FSDP2's own gathers; "
                         "bmtwrap gathers the weights itself: leave it False")
    return Float8Choice("config", fp8)


def check_device(choice: Float8Choice, device: torch.device) -> None:
    """Refuse float8 compute where the device has none (torchao's emulation runs anywhere)."""
    if choice.config.emulate:
        return
    if device.type != "cuda":
        raise RuntimeError(f"wrap(fp8={choice.recipe!r}) needs a CUDA GPU with float8 tensor cores (compute capability "
                           f"8.9 or more: L4, H100, H200, B200); this process runs on {device.type}. Leave fp8 off "
                           "here (torchao's Float8LinearConfig(emulate=True) emulates it, for tests only)")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise RuntimeError(f"wrap(fp8={choice.recipe!r}): {torch.cuda.get_device_name(device)} (compute capability "
                           f"{major}.{minor}) has no float8 tensor cores; they need 8.9 or more (L4, H100, H200, "
                           "B200). Leave fp8 off on this GPU")


def _convertible(module: nn.Module) -> bool:
    return (type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def _inner_linears(block: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The linear layers inside ``block`` (a block that is itself an ``nn.Linear`` keeps its class: the engine
    runs that very module, which a conversion would replace by another)."""
    return [(name, m) for name, m in block.named_modules() if name and isinstance(m, nn.Linear)]


def float8_linears(blocks: Sequence[Tuple[str, nn.Module]]) -> Tuple[int, int]:
    """How many of the blocks' linear layers convert to float8, and how many linear layers they have."""
    linears = [m for _, block in blocks for m in block.modules() if isinstance(m, nn.Linear)]
    inner = [m for _, block in blocks for _, m in _inner_linears(block)]
    return sum(map(_convertible, inner)), len(linears)


def convert_blocks(blocks: Sequence[Tuple[str, nn.Module]], choice: Float8Choice) -> None:
    """Swap the convertible ``nn.Linear`` modules inside the blocks for torchao's ``Float8Linear``, in place (the same
    parameter objects); the others stay in the model's dtype."""
    float8 = _torchao()
    for _, block in blocks:
        float8.convert_to_float8_training(block, config=choice.config,
                                          module_filter_fn=lambda module, fqn: bool(fqn) and _convertible(module))


def describe(choice: Optional[Float8Choice], blocks: Sequence[Tuple[str, nn.Module]]) -> str:
    """One line for the plan: the recipe and how many of the blocks' linears compute in float8."""
    if choice is None:
        return "off"
    converted, total = float8_linears(blocks)
    return f"{choice.recipe}: {converted} of the blocks' {total} linear layers in float8"
