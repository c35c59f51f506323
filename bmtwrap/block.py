"""Block: BMTrain's module wrapper that runs one module as a ZeRO block.

The engine's side (gather, prefetch, checkpointing, gradient reduction) is
:class:`~bmtwrap.runners.BlockRunner` (see [Note: block lifetime in a step] in runners.py); this
file adds what BMTrain programs see: a module holding the wrapped one, a name per block, and
state-dict keys without the ``_module.`` level.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

import torch
from torch import nn

from .full_state import shard_full_tensors
from .offload import OffloadPolicy
from .runners import BlockModule, BlockRunner
from .schedule import engine

__all__ = ["Block", "CheckpointBlock"]


def _unique_name(module: nn.Module) -> str:
    return f"{type(module).__name__}#{engine().next_block_number()}"


def _strip_module_prefix(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    inner = prefix + "_module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_module_prefix(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    inner = prefix + "_module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


class Block(BlockModule):
    """A module whose parameters are sharded together and gathered as one (BMTrain's ``Block``).

    Wrapping a module shards its parameters at once: each becomes a 1-D view of this rank's
    piece. Calling the block gathers them (prefetched while the previous block computes), runs
    the module with every positional and keyword argument, and returns whatever it returns;
    backward reduce-scatters the gradients (averaged over ranks) into the pieces' ``.grad``.

    Args:
        inner_module: the module to run as a block.
        use_checkpoint: recompute activations in backward (default) instead of storing them.
        zero_level: 3 frees gathered parameters after forward, 2 keeps them for backward;
            default: the value given to :func:`bmtwrap.init_distributed`.
        reduce_dtype: dtype gradients are averaged in; default: the parameters' own.
        offload_params: keep this block's parameter shards (and their gradients) in pinned CPU
            memory; the GPU holds them only while the block is gathered (see :func:`bmtwrap.wrap`).

    State dict keys are the inner module's, without a ``_module.`` level, as in BMTrain; its
    values are this rank's pieces. ``load_state_dict`` accepts pieces or full-shaped tensors.

    Raises:
        TypeError: ``inner_module`` is not an ``nn.Module``.
        ValueError: parameters on several devices or on another GPU than this process's; a
            parameter another block already owns; ``zero_level`` not 2 or 3.
        RuntimeError: :func:`bmtwrap.init_distributed` was not called.

    Example::

        layers = bmt.TransformerBlockList([bmt.Block(Layer(dim)) for _ in range(12)])
        h = layers(h, mask)
    """

    def __init__(self, inner_module: nn.Module, use_checkpoint: bool = True, zero_level: Optional[int] = None,
                 *, reduce_dtype: Optional[torch.dtype] = None, offload_params: bool = False) -> None:
        if not isinstance(inner_module, nn.Module):
            raise TypeError(
                f"Block expects an nn.Module, got {type(inner_module).__name__}; wrap the layer module itself"
            )
        if isinstance(inner_module, Block):
            raise TypeError("Block got a Block; a module is wrapped once")
        super().__init__()
        self._module = inner_module
        self._runner = BlockRunner(inner_module, _unique_name(inner_module), recompute=use_checkpoint,
                                   zero_level=zero_level, reduce_dtype=reduce_dtype,
                                   offload=OffloadPolicy(params=offload_params))
        self._owner_list: Optional["weakref.ref[nn.Module]"] = None  # the TransformerBlockList holding it
        self.register_state_dict_post_hook(_strip_module_prefix)
        self.register_load_state_dict_pre_hook(_add_module_prefix)  # must run before the next one
        self.register_load_state_dict_pre_hook(shard_full_tensors)

    @property
    def runner(self) -> BlockRunner:
        """The engine's side of this block: its parameter group, checkpointing and prefetch links."""
        return self._runner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the parameters, run the inner module with every argument, return what it returns."""
        return self._runner.run(self._module, args, kwargs)


CheckpointBlock = Block
"""BMTrain's other name of :class:`Block` (the same class)."""
