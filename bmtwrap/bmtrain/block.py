"""Block: BMTrain's module wrapper that runs one module as a ZeRO block.

The engine's side (gather, prefetch, checkpointing, gradient reduction) is
:class:`~bmtwrap.engine.runners.BlockRunner` (see [Note: block lifetime in a step] in runners.py); this
file adds what BMTrain programs see: a module standing for the wrapped one, a name per block,
attributes read through to the inner module, and BMTrain's sharing rules.

[Note: a block is a view of its module]
As in BMTrain, a block shares its inner module's ``_parameters``, ``_buffers`` and ``_modules``
dicts (the same dict objects, not copies): ``block._parameters["weight"]`` is the inner module's
weight, and ``named_parameters()``, ``state_dict()``, ``.to()``/``.half()`` and ``load_state_dict``
see the inner module's tree with no ``_module.`` level, so each parameter is reached once. The
inner module itself is held in the block's ``__dict__`` (``block._module``), not among the
modules torch walks: ``block.modules()`` lists the block, then the inner module's submodules.
The inner module's own ``_save_to_state_dict``/``_load_from_state_dict`` (and extra state) do
the block's, and ``train()`` reaches it.

[Note: blocks that share a runner]
One runner (one group of parameters) may serve several ``Block`` objects, as BMTrain's reference
blocks do:
- a plain module listed twice in a :class:`~bmtwrap.TransformerBlockList` becomes two blocks over
  one runner (weights shared across depth);
- ``Block(m)`` where ``wrap`` already made ``m`` a block (``BMTrainModelWrapper(model)``, then
  ``TransformerBlockList(model.layers)``) adopts wrap's runner: calling ``m`` already runs it
  through the runner, so the block calls ``m`` and wrap's root stays in charge of the rest.
A module that a wrapped model holds inside (``Block(BMTrainModelWrapper(sub))``) is not shared: the
wrapping is undone and the block shards those parameters itself.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn

from ..engine.dist import is_initialized
from ..engine.full_state import register_full_state_dict, shard_full_tensors
from ..engine.offload import OffloadPolicy
from ..engine.runners import BlockModule, BlockRunner
from ..engine.schedule import engine

__all__ = ["Block", "BlockSharingError", "CheckpointBlock"]


def _unique_name(module: nn.Module) -> str:
    return f"{type(module).__name__}#{engine().next_block_number()}"


def _runner_wrap_installed(module: nn.Module) -> Optional[BlockRunner]:
    """The runner :func:`bmtwrap.wrap` made ``module`` a block with (calling ``module`` runs it), or ``None``."""
    runner = engine().block_runner_of(module)
    installed = getattr(module.__dict__.get("forward"), "block_runner", None)
    return runner if runner is not None and runner is installed else None


class BlockSharingError(ValueError, AssertionError):
    """A ``Block`` given twice to one block list.

    A ``ValueError`` (bad input); also an ``AssertionError``, which is what BMTrain raises here,
    so that code catching BMTrain's error keeps working.
    """


class Block(BlockModule):
    """A module whose parameters are sharded together and gathered as one (BMTrain's ``Block``).

    Wrapping a module shards its parameters at once: each becomes a 1-D view of this rank's
    piece. Calling the block gathers them (prefetched while the previous block computes), runs
    the module with every positional and keyword argument, and returns whatever it returns
    (a list as a tuple, as BMTrain's block does); backward reduce-scatters the gradients
    (averaged over ranks) into the pieces' ``.grad``. Attributes the block does not have are
    read from the inner module (``block.linear.weight``), as in BMTrain.

    Args:
        inner_module: the module to run as a block. A module that :func:`bmtwrap.wrap` made a
            block is adopted with its sharding; a wrapped model inside is re-sharded as part of
            this block (see [Note: blocks that share a runner]).
        use_checkpoint: recompute activations in backward (default) instead of storing them.
        zero_level: 3 frees gathered parameters after forward, 2 keeps them for backward;
            default: the value given to :func:`bmtwrap.init_distributed`.
        initialized: BMTrain's flag for a block whose storage another block made; accepted and
            not needed (bmtwrap shards at construction, and shares storage by itself).
        mode: ``"BLOCK"`` or ``"PIPE"`` (BMTrain's mark of a block meant for a
            :class:`~bmtwrap.PipelineTransformerBlockList`); both build the same block, and either
            may go into either list.
        reduce_dtype: dtype gradients are averaged in; default: the parameters' own.
        offload_params: keep this block's parameter shards (and their gradients) in pinned CPU
            memory; the GPU holds them only while the block is gathered (see :func:`bmtwrap.wrap`).

    The block stands for its inner module, as in BMTrain: ``block._parameters``, ``_buffers`` and
    ``_modules`` are the inner module's own dicts, so parameter names and state dict keys are the
    inner module's, with no ``_module.`` level (see [Note: a block is a view of its module]); the
    inner module is ``block._module``. State dict values are full-shaped CPU tensors:
    ``state_dict()`` is a collective that gathers the block (``keep_vars=True`` gives the sharded
    parameters themselves). ``load_state_dict`` accepts
    full-shaped tensors or this rank's pieces.

    Raises:
        TypeError: ``inner_module`` is not an ``nn.Module``, or is a ``Block``.
        ValueError: parameters on several devices or on another GPU than this process's; a
            parameter another ``Block`` already owns; ``zero_level`` not 2 or 3; an unknown ``mode``.
        RuntimeError: :func:`bmtwrap.init_distributed` was not called.

    Example::

        layers = bmt.TransformerBlockList([bmt.Block(Layer(dim)) for _ in range(12)])
        h = layers(h, mask)
    """

    def __init__(self, inner_module: nn.Module, use_checkpoint: bool = True, zero_level: Optional[int] = None,
                 initialized: bool = False, mode: str = "BLOCK", *, reduce_dtype: Optional[torch.dtype] = None,
                 offload_params: bool = False) -> None:
        if not isinstance(inner_module, nn.Module):
            raise TypeError(
                f"Block expects an nn.Module, got {type(inner_module).__name__}; wrap the layer module itself"
            )
        if isinstance(inner_module, Block):
            raise TypeError("Block got a Block; a module is wrapped once")
        if mode not in ("BLOCK", "PIPE"):
            raise ValueError(f"Block mode must be 'BLOCK' or 'PIPE', got {mode!r}")
        del initialized  # see the docstring
        super().__init__()
        self._view(inner_module)
        self._mode = mode
        eng = engine()
        # A model wrapped on its own (BMTrainModelWrapper) inside: its parameters join this block.
        eng.dissolve_wrapped_under(inner_module)
        adopted = _runner_wrap_installed(inner_module)
        if adopted is not None:
            self._runner: BlockRunner = adopted  # a block wrap made: calling the module runs it
            self._calls_module = True
        else:
            self._runner = BlockRunner(inner_module, _unique_name(inner_module), recompute=use_checkpoint,
                                       zero_level=zero_level, reduce_dtype=reduce_dtype,
                                       offload=OffloadPolicy(params=offload_params))
            self._calls_module = False
        self._setup()

    def _view(self, inner_module: nn.Module) -> None:
        """Stand for ``inner_module``: share its dicts of parameters, buffers and submodules (see
        [Note: a block is a view of its module])."""
        object.__setattr__(self, "_module", inner_module)
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, name, getattr(inner_module, name))

    def _setup(self) -> None:
        self._owner_list: Optional["weakref.ref[nn.Module]"] = None  # the TransformerBlockList holding it
        register_full_state_dict(self)
        self.register_load_state_dict_pre_hook(shard_full_tensors)

    def _sharing(self) -> "Block":
        """A second block over the same module and runner (a module listed twice in a block list)."""
        twin = Block.__new__(Block)
        BlockModule.__init__(twin)
        twin._view(self._module)
        twin._mode = self._mode
        twin._runner = self._runner
        twin._calls_module = self._calls_module
        twin._setup()
        return twin

    def train(self, mode: bool = True) -> "Block":
        """Set training mode on the block and its inner module (which ``children()`` does not list)."""
        self._module.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_module":  # not set yet (inside __init__)
                raise
            return getattr(self._module, name)

    @property
    def runner(self) -> BlockRunner:
        """The engine's side of this block: its parameter group, checkpointing and prefetch links."""
        return self._runner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the parameters, run the inner module with every argument, return what it returns
        (a list as a tuple, as BMTrain's block does)."""
        if self._calls_module:
            out = self._module(*args, **kwargs)
        else:
            out = self._runner.run(self._module, args, kwargs)
        return tuple(out) if isinstance(out, list) else out


class _CheckpointBlockType(type):
    """``isinstance(m, CheckpointBlock)`` is true of a :class:`Block` and of a layer ``wrap`` made a block
    (see [Note: wrap's layers are checkpoint blocks])."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, Block) or (isinstance(instance, nn.Module) and is_initialized()
                                               and _runner_wrap_installed(instance) is not None)


class CheckpointBlock(Block, metaclass=_CheckpointBlockType):
    """BMTrain's other name of :class:`Block`: ``CheckpointBlock(m)`` builds a :class:`Block`.

    [Note: wrap's layers are checkpoint blocks]
    BMTrain's ``BMTrainModelWrapper`` turns each repeated layer into a ``CheckpointBlock``, and its
    programs check that (``assert isinstance(layer, bmt.CheckpointBlock)``). ``wrap`` (which
    ``BMTrainModelWrapper`` is) keeps each layer's own class and runs it through a block runner,
    so ``isinstance(layer, CheckpointBlock)`` is true of such a layer as of a :class:`Block`.
    ``isinstance(layer, Block)`` stays strict: bmtwrap's own code tells the two apart by it.
    """
