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

The blocks at both ends stay in the model's dtype: by default the first two and the last two (as
Megatron-LM's float8 training can), never more than a quarter of the blocks in all (``len // 8`` at
each end, so models of fewer than 8 blocks convert every block). ``Float8(keep_ends=N)`` sets the
number. The reason is measured: a 1B Llama trained 1,000 steps on the same text
(``benchmarks/fp8_convergence.py``, three seeds on an H200) ended 3.1 % above bf16's training loss
on average with every block in tensorwise float8, and 0.3 % above with the two blocks at each end
in bf16, lower than every block in float8 at each seed. It costs a share of the speed: 5 % of
float8's at the 8B on two H200s, where 4 of its 32 blocks compute in bf16.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

__all__ = ["FP8_RECIPES", "Float8", "Float8Choice", "check_device", "convert_blocks", "describe", "float8_choice",
           "float8_linears"]

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

KEEP_ENDS = 2  # blocks at each end left in the model's dtype, unless a quarter of the blocks is fewer


@dataclasses.dataclass(frozen=True)
class Float8:
    """``wrap(fp8=Float8(...))``: a float8 recipe and how many blocks at each end stay in the model's dtype.

    Args:
        recipe: a torchao recipe name (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``) or a torchao
            ``Float8LinearConfig``.
        keep_ends: the number of blocks at the start and at the end (each) whose linear layers stay in the
            model's dtype; ``None`` (default): 2, or fewer where 2 at each end would be more than a quarter of
            the blocks. See [Note: float8 blocks].
    """

    recipe: Any = "tensorwise"
    keep_ends: Optional[int] = None


FP8Option = Union[bool, str, Float8, Any]  # True, False, a recipe name, a Float8, or a torchao Float8LinearConfig


@dataclasses.dataclass(frozen=True)
class Float8Choice:
    """What ``fp8`` asked for: the recipe's name (or ``"config"`` for a config given as it is), torchao's config,
    and the blocks at each end kept in the model's dtype (``None``: the default's rule)."""

    recipe: str
    config: Any  # torchao.float8.Float8LinearConfig
    keep_ends: Optional[int] = None

    @property
    def compared(self) -> Any:
        """A value that is equal for two ``wrap`` calls asking for the same float8 compute."""
        return (self.recipe if self.recipe != "config" else self.config, self.keep_ends)

    def kept(self, blocks: int) -> int:
        """How many of ``blocks`` blocks at each end stay in the model's dtype."""
        if self.keep_ends is None:
            return min(KEEP_ENDS, blocks // 8)
        if blocks and 2 * self.keep_ends >= blocks:
            raise ValueError(f"fp8=Float8(keep_ends={self.keep_ends}): the model has {blocks} blocks, and keeping "
                             f"{self.keep_ends} at each end in its dtype leaves none in float8; give keep_ends below "
                             f"{(blocks + 1) // 2}, or leave fp8 off")
        return self.keep_ends


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
    if isinstance(fp8, Float8):
        keep = fp8.keep_ends
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
            raise ValueError(f"fp8=Float8(keep_ends={keep!r}): give a whole number of blocks >= 0, or None for the "
                             f"default ({KEEP_ENDS} at each end, at most a quarter of the blocks)")
        if isinstance(fp8.recipe, (bool, Float8)) or fp8.recipe is None:
            raise TypeError(f"fp8=Float8(recipe={fp8.recipe!r}): the recipe is a name ({', '.join(FP8_RECIPES)}) "
                            "or a torchao Float8LinearConfig")
        return dataclasses.replace(float8_choice(fp8.recipe), keep_ends=keep)
    if fp8 is True:
        fp8 = "tensorwise"
    if isinstance(fp8, str):
        if fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8={fp8!r} is not a float8 recipe; give True (tensorwise), one of "
                             f"{', '.join(map(repr, FP8_RECIPES))}, a torchao Float8LinearConfig, or False")
        return Float8Choice(fp8, _torchao().Float8LinearConfig.from_recipe_name(fp8))
    float8 = _torchao()
    if not isinstance(fp8, float8.Float8LinearConfig):
        raise TypeError(f"fp8 must be True, False, a recipe name ({', '.join(FP8_RECIPES)}), a bmtwrap.Float8 or "
                        f"a torchao Float8LinearConfig, got {type(fp8).__name__}")
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


def float8_blocks(blocks: Sequence[Tuple[str, nn.Module]], choice: Float8Choice) -> Sequence[Tuple[str, nn.Module]]:
    """The blocks that compute in float8: all but the ones ``choice`` keeps at each end."""
    kept = choice.kept(len(blocks))
    return blocks[kept : len(blocks) - kept]


def float8_linears(blocks: Sequence[Tuple[str, nn.Module]], choice: Float8Choice) -> Tuple[int, int]:
    """How many of the blocks' linear layers convert to float8, and how many linear layers they have."""
    linears = [m for _, block in blocks for m in block.modules() if isinstance(m, nn.Linear)]
    inner = [m for _, block in float8_blocks(blocks, choice) for _, m in _inner_linears(block)]
    return sum(map(_convertible, inner)), len(linears)


def convert_blocks(blocks: Sequence[Tuple[str, nn.Module]], choice: Float8Choice) -> None:
    """Swap the convertible ``nn.Linear`` modules inside the blocks for torchao's ``Float8Linear``, in place (the same
    parameter objects); the others, and the blocks kept at both ends, stay in the model's dtype."""
    float8 = _torchao()
    for _, block in float8_blocks(blocks, choice):
        float8.convert_to_float8_training(block, config=choice.config,
                                          module_filter_fn=lambda module, fqn: bool(fqn) and _convertible(module))


def describe(choice: Optional[Float8Choice], blocks: Sequence[Tuple[str, nn.Module]]) -> str:
    """One line for the plan: the recipe, how many of the blocks' linears compute in float8, the blocks kept."""
    if choice is None:
        return "off"
    converted, total = float8_linears(blocks, choice)
    kept = choice.kept(len(blocks))
    ends = {0: "", 1: " (the first and last block in the model's dtype)"}.get(
        kept, f" (the first and last {kept} blocks in the model's dtype)")
    return f"{choice.recipe}: {converted} of the blocks' {total} linear layers in float8{ends}"
