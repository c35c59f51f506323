"""What the converter needs to know about a family of models, as one small policy object each.

The converter calls an adapter at fixed points and never branches on the model type itself;
support for another library is another adapter: a subclass of :class:`ModelAdapter` with its own
:meth:`~ModelAdapter.build` (does this model belong to the family?), declared with
:func:`register_adapter`. :func:`adapter_for` asks the most derived adapters first, the newest
first among siblings, so a family can specialise another (a subclass of :class:`HFAdapter` for
one architecture) without editing the dispatcher. The subclasses themselves are the registry:
no list of ours to keep in step.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type, TypeVar

from torch import nn
from torch.utils.hooks import RemovableHandle

from .head_loss import covered_head, install_head_loss

__all__ = ["HFAdapter", "ModelAdapter", "adapter_for", "register_adapter"]

A = TypeVar("A", bound=Type["ModelAdapter"])


class ModelAdapter:
    """Plain ``nn.Module`` models: nothing to prepare; modules initialise with ``reset_parameters``.

    The base of every family's adapter (see :func:`register_adapter`).
    """

    @classmethod
    def build(cls, model: nn.Module) -> Optional["ModelAdapter"]:
        """This family's adapter for ``model``, or ``None`` when the model is not of the family.

        The base class takes any model: it is the fallback.
        """
        return cls()

    def prepare(self, model: nn.Module) -> None:
        """Called once before sharding; may register hooks on the model."""

    def entry_points(self, model: nn.Module) -> List[nn.Module]:
        """The modules whose forward may start a step: the model, and any model inside it that its
        methods call directly. The root group is gathered around the outermost of these calls."""
        return [model]

    def loss_head(self, model: nn.Module) -> Optional[nn.Module]:
        """The output projection through which :meth:`loss_without_logits` computes the loss, if it does."""
        return None

    def loss_without_logits(self, model: nn.Module) -> Tuple[List[RemovableHandle], Optional[Callable[[], None]]]:
        """Make the model compute its training loss without materialising its logits, where it can: returns
        the hooks' handles and what undoes the rest (``None``: nothing was installed)."""
        return [], None

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
    - A causal LM trained with ``labels`` computes its loss from the last hidden state, without the
      logits (see [Note: the loss without the logits] in ``head_loss.py``).
    - Initialisation uses the model's own ``_init_weights`` (nearest ``PreTrainedModel``), which
      also recomputes non-persistent buffers such as rotary ``inv_freq``.
    """

    def __init__(self, hf: nn.Module) -> None:
        self.hf = hf

    @classmethod
    def build(cls, model: nn.Module) -> Optional["ModelAdapter"]:
        """The adapter of the outermost transformers model in the tree, if there is one."""
        hf = next((m for m in model.modules() if _is_hf_model(m)), None)
        return cls(hf) if hf is not None else None

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

    def loss_head(self, model: nn.Module) -> Optional[nn.Module]:
        return covered_head(self.hf)

    def loss_without_logits(self, model: nn.Module) -> Tuple[List[RemovableHandle], Optional[Callable[[], None]]]:
        return install_head_loss(self.hf)

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


def register_adapter(cls: A) -> A:
    """Declare a family's adapter; use it as a class decorator.

    Defining the subclass is what makes :func:`adapter_for` consider it: subclasses are asked
    before their base, the newest sibling first. The decorator checks the class and names the
    intent.

    Raises:
        TypeError: ``cls`` is not a subclass of :class:`ModelAdapter`, or does not define its own
            ``build``.

    Example::

        @bmtwrap.wrap.adapters.register_adapter
        class MyFamilyAdapter(ModelAdapter):
            @classmethod
            def build(cls, model):
                return cls() if isinstance(model, MyFamilyModel) else None

            def prepare(self, model):
                model.disable_own_checkpointing()
    """
    if not (isinstance(cls, type) and issubclass(cls, ModelAdapter)) or cls is ModelAdapter:
        raise TypeError(f"register_adapter expects a subclass of ModelAdapter, got {cls!r}")
    if "build" not in vars(cls):
        raise TypeError(f"{cls.__name__} must define its own classmethod build(model) -> adapter or None; "
                        "without it, it would claim every model its base claims")
    return cls


def _candidates(cls: Type[ModelAdapter]) -> Iterator[Type[ModelAdapter]]:
    """``cls``'s subclasses, most derived first, newest first among siblings; then ``cls``.

    Only classes with a ``build`` of their own are families; one without (a mixin, a base
    extended by others) would claim every model its base claims.
    """
    for sub in reversed(cls.__subclasses__()):
        yield from _candidates(sub)
    if "build" in vars(cls):
        yield cls


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter of the most specific family ``model`` belongs to (plain modules: :class:`ModelAdapter`)."""
    for cls in _candidates(ModelAdapter):
        adapter = cls.build(model)
        if adapter is not None:
            return adapter
    raise AssertionError("ModelAdapter.build accepts every model")
