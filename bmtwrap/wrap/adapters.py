"""What the converter needs to know about a family of models, as one small policy object each.

The converter calls an adapter at fixed points and never branches on the model type itself;
support for another library is another adapter.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict

from torch import nn

__all__ = ["ModelAdapter", "HFAdapter", "adapter_for"]


class ModelAdapter:
    """Plain ``nn.Module`` models: nothing to prepare; modules initialise with ``reset_parameters``."""

    def prepare(self, model: nn.Module) -> None:
        """Called once before sharding."""

    def forward_kwargs(self, model: nn.Module, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """Adjust the root forward's keyword arguments (called at every forward)."""
        return kwargs

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
    """Hugging Face Transformers models.

    - HF's own activation checkpointing is switched off: bmtwrap's blocks replace it.
    - ``_is_fsdp_managed_module = True`` makes ``generate()`` keep every rank stepping until all
      are done (``synced_gpus``), as each step runs collectives.
    - In training, ``use_cache=False`` is passed unless the caller chose: a key/value cache is
      useless there and costs memory.
    - Initialisation uses the model's own ``_init_weights`` (nearest ``PreTrainedModel``), which
      also recomputes non-persistent buffers such as rotary ``inv_freq``.
    """

    def prepare(self, model: nn.Module) -> None:
        # Transformers renamed gradient checkpointing to activation checkpointing; ask the newest name first.
        for flag, disable in (("is_activation_checkpointing", "activation_checkpointing_disable"),
                              ("is_gradient_checkpointing", "gradient_checkpointing_disable")):
            if hasattr(type(model), flag):
                if getattr(model, flag):
                    getattr(model, disable)()
                break
        model._is_fsdp_managed_module = True
        self._takes_use_cache = "use_cache" in inspect.signature(model.forward).parameters

    def forward_kwargs(self, model: nn.Module, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        if model.training and self._takes_use_cache and "use_cache" not in kwargs:
            kwargs = dict(kwargs, use_cache=False)
        return kwargs

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


def adapter_for(model: nn.Module) -> ModelAdapter:
    return HFAdapter() if _is_hf_model(model) else ModelAdapter()
