"""What the converter needs to know about a family of models, as one small policy object each.

The converter calls an adapter at fixed points and never branches on the model type itself;
support for another library is another adapter.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Tuple

from torch import nn

__all__ = ["ModelAdapter", "HFAdapter", "adapter_for"]


class ModelAdapter:
    """Plain ``nn.Module`` models: nothing to prepare; modules initialise with ``reset_parameters``."""

    def prepare(self, model: nn.Module) -> None:
        """Called once before sharding; may register hooks on the model."""

    def entry_points(self, model: nn.Module) -> List[nn.Module]:
        """The modules whose forward may start a step: the model, and any model inside it that its
        methods call directly. The root group is gathered around the outermost of these calls."""
        return [model]

    def initializer(self, model: nn.Module) -> Callable[[nn.Module], None]:
        """A function that initialises one module's own parameters and buffers in place."""

        def reset(module: nn.Module) -> None:
            reset_parameters = getattr(module, "reset_parameters", None)
            if callable(reset_parameters):
                reset_parameters()

        return reset


def _is_hf_model(model: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
               for cls in type(model).__mro__)


class HFAdapter(ModelAdapter):
    """Hugging Face Transformers models, also inside a wrapper (a peft model, say).

    ``hf`` is the outermost ``PreTrainedModel`` in the tree: the model itself, or the one a
    wrapper holds.

    - HF's own activation checkpointing is switched off: bmtwrap's blocks replace it.
    - ``_is_fsdp_managed_module = True`` makes ``generate()`` keep every rank stepping until all
      are done (``synced_gpus``), as each step runs collectives.
    - In training, ``use_cache=False`` is passed unless the caller chose: a key/value cache is
      useless there and costs memory.
    - Initialisation uses the model's own ``_init_weights`` (nearest ``PreTrainedModel``), which
      also recomputes non-persistent buffers such as rotary ``inv_freq``.
    """

    def __init__(self, hf: nn.Module) -> None:
        self.hf = hf

    def prepare(self, model: nn.Module) -> None:
        hf = self.hf
        # Transformers renamed gradient checkpointing to activation checkpointing; ask the newest name first.
        for flag, disable in (("is_activation_checkpointing", "activation_checkpointing_disable"),
                              ("is_gradient_checkpointing", "gradient_checkpointing_disable")):
            if hasattr(type(hf), flag):
                if getattr(hf, flag):
                    getattr(hf, disable)()
                break
        hf._is_fsdp_managed_module = True
        model._is_fsdp_managed_module = True
        if "use_cache" in inspect.signature(hf.forward).parameters:
            hf.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)

    def entry_points(self, model: nn.Module) -> List[nn.Module]:
        # A wrapper (peft) runs generate() on the transformers model inside it, which calls its own forward.
        return [model] if self.hf is model else [model, self.hf]

    def initializer(self, model: nn.Module) -> Callable[[nn.Module], None]:
        owners: Dict[int, nn.Module] = {}

        def assign(module: nn.Module, owner: nn.Module) -> None:
            for child in module.children():
                assign(child, child if _is_hf_model(child) else owner)
            owners[id(module)] = owner

        assign(model, model)

        def init(module: nn.Module) -> None:
            owners.get(id(module), model)._init_weights(module)

        return init


def _no_cache_in_training(module: nn.Module, args: Tuple[Any, ...],
                          kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    # A key/value cache is useless in training, costs memory, and would be appended to again when a
    # checkpointed block recomputes.
    if module.training and "use_cache" not in kwargs:
        kwargs = dict(kwargs, use_cache=False)
    return args, kwargs


def adapter_for(model: nn.Module) -> ModelAdapter:
    hf = next((m for m in model.modules() if _is_hf_model(m)), None)
    return HFAdapter(hf) if hf is not None else ModelAdapter()
