"""TRL's ``SFTTrainer`` and ``DPOTrainer`` on a model sharded by bmtwrap.

A TRL script switches by one import: ``from bmtwrap.hf import SFTTrainer`` (or ``DPOTrainer``)
instead of ``from trl import ...``; its config, datasets, ``peft_config=``, ``train()`` and
``save_model()`` stay as they are. ``bmtwrap.hf`` imports this module, and so trl, only when one
of these names is used.

[Note: TRL on a sharded model]
Each class is TRL's trainer with :class:`bmtwrap.hf.ShardedTrainerMixin` listed last, right above
``transformers.Trainer``. TRL's ``__init__`` runs first and prepares the model as it always does:
loads it from a name with ``model_init_kwargs``, adds the peft adapters of ``peft_config`` (and, for
a peft model passed in, DPO's frozen ``"ref"`` copy of its adapter), tokenizes the datasets, picks
its collator (``padding_free``, packing). Its call of ``transformers.Trainer.__init__`` then reaches
the mixin, which shards that prepared model; what TRL does after (its fused LM head, reading
``lm_head.weight`` inside the model's forward, where bmtwrap has gathered it) runs on the sharded
model. So:

- ``gradient_checkpointing`` (on by default in TRL's configs) is switched off on the arguments, so
  Hugging Face's checkpointing stays off inside bmtwrap's blocks (TRL's
  ``disable_gradient_checkpointing`` around the reference forward finds it off and leaves it so),
  and becomes bmtwrap's: for :class:`SFTTrainer`, ``wrap(checkpoint="auto")``, which recomputes the
  blocks whose activations do not fit the card and keeps the rest. TRL turns the flag on for every
  user to save memory, and ``"auto"`` saves what the card needs, no more (on 2 GPUs at 8B, 2 x 4096
  tokens each, on H200s, 1.28x faster than recomputing every block: ``benchmarks/RESULTS.md``);
  ``wrap_options={"checkpoint": True}`` recomputes every block. For :class:`DPOTrainer` and
  :func:`sharded` trainers it is ``wrap(checkpoint=True)``, as with :class:`bmtwrap.hf.Trainer`:
  their second model (DPO's reference) is sharded after the trained model's blocks are planned.
- DPO's reference model, yours (``ref_model=``) or the one TRL loads from the model's name, reaches
  the accelerator unwrapped, through ``accelerator.prepare_model(ref, evaluation_mode=True)``:
  it is sharded there like the trained model (without checkpointing), frozen and in eval mode.
  Every rank runs its forward on its own part of the batch, as for the trained model.
- With a peft model and no ``ref_model``, TRL's reference is the same sharded model with the
  adapters disabled (or its ``"ref"`` adapter active): peft's switch acts inside the layers bmtwrap
  runs, so nothing else is needed. ``accelerator.unwrap_model`` gives the model itself (it is
  wrapped in nothing).
- ``precompute_ref_log_probs=True`` runs the reference (or, before training, the model) over the
  datasets on every rank, each its own part, as TRL does under DDP (and, as there, needs a dataset
  with files: TRL caches the log-probabilities next to them for every rank to read).

Refused before anything is built: ``activation_offloading`` and selective activation
checkpointing, whose saved-tensor hooks and checkpoint wrappers were not made for bmtwrap's blocks
(which gather, release and recompute their parameters); bmtwrap's own checkpointing and
``wrap_options={"offload_params": True}`` save that memory instead. And everything
:class:`bmtwrap.hf.Trainer` refuses.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Union

import transformers
import trl

from .hf import ShardedTrainerMixin
from .hf_limits import refuse_trl_options

__all__ = ["SFTTrainer", "DPOTrainer", "sharded"]


def _set_sharding_options(trainer: ShardedTrainerMixin, given: Iterable[Any], wrap_options: Optional[Dict[str, Any]],
                         offload: Union[bool, str]) -> None:
    """For the ``__init__`` of a class that puts :class:`~bmtwrap.hf.ShardedTrainerMixin` under a trainer whose own
    ``__init__`` takes no ``wrap_options`` (TRL's): refuse the TRL settings that cannot work (``given``: the
    trainer's arguments), and keep the options for the mixin, which that ``__init__`` reaches with
    ``transformers.Trainer``'s arguments only."""
    refuse_trl_options(given, trainer._public_name)
    trainer._sharding_options = (wrap_options, offload)


def sharded(trainer_class: type) -> type:
    """``trainer_class``, a subclass of ``transformers.Trainer`` (a TRL trainer), training a model sharded by bmtwrap.

    The class returned lists :class:`~bmtwrap.hf.ShardedTrainerMixin` last, under ``trainer_class``, and takes
    ``trainer_class``'s arguments and ``wrap_options=`` and ``offload=`` (as :class:`bmtwrap.hf.Trainer`).
    :class:`SFTTrainer` and :class:`DPOTrainer` are made the same way (with docstrings of their own) and
    tested against TRL's own; trainers made by this function are not, beyond the composition itself.

    Args:
        trainer_class: the trainer class, e.g. ``trl.KTOTrainer``.

    Returns:
        The class, of the same name.

    Raises:
        TypeError: ``trainer_class`` is not a subclass of ``transformers.Trainer``.

    Example::

        KTOTrainer = bmtwrap.hf.sharded(trl.KTOTrainer)  # instead of: from trl import KTOTrainer
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"sharded() takes a subclass of transformers.Trainer, got {trainer_class!r}")

    def __init__(self: ShardedTrainerMixin, *args: Any, wrap_options: Optional[Dict[str, Any]] = None,
                 offload: Union[bool, str] = "auto", **kwargs: Any) -> None:
        _set_sharding_options(self, (*args, *kwargs.values()), wrap_options, offload)
        trainer_class.__init__(self, *args, **kwargs)

    name = trainer_class.__name__
    return type(name, (trainer_class, ShardedTrainerMixin), {
        "__init__": __init__, "__module__": "bmtwrap.hf", "__qualname__": name,
        "__doc__": f"{trainer_class.__module__}.{name} on a model sharded by bmtwrap (bmtwrap.hf.sharded).",
        "_public_name": f"bmtwrap.hf.sharded({name})"})


class SFTTrainer(trl.SFTTrainer, ShardedTrainerMixin):
    """TRL's ``SFTTrainer``, training a model sharded by bmtwrap (ZeRO-3).

    Takes every argument ``trl.SFTTrainer`` takes and behaves the same; underneath, what
    :class:`bmtwrap.hf.Trainer` changes (see its docstring) and [Note: TRL on a sharded model]
    in :mod:`bmtwrap.hf_trl`. Import it as ``from bmtwrap.hf import SFTTrainer``.

    Args:
        *args: ``trl.SFTTrainer``'s arguments by position (``model``, ``args``, ...).
        wrap_options: keyword arguments for :func:`bmtwrap.wrap`, as for :class:`bmtwrap.hf.Trainer`,
            except that ``checkpoint`` is ``"auto"`` unless given, also under TRL's default
            ``gradient_checkpointing=True`` (see [Note: TRL on a sharded model]).
        offload: the optimizer's choice, as for :class:`bmtwrap.hf.Trainer`.
        **kwargs: ``trl.SFTTrainer``'s arguments by name (``train_dataset``, ``peft_config``, ...).

    Raises:
        NotImplementedError: ``activation_offloading=True``, ``gradient_checkpointing_kwargs``
            with ``selective``, or a setting :class:`bmtwrap.hf.Trainer` refuses.

    Example::

        from trl import SFTConfig
        from bmtwrap.hf import SFTTrainer  # instead of: from trl import SFTTrainer

        trainer = SFTTrainer(model="Qwen/Qwen3-0.6B", args=SFTConfig("out"), train_dataset=data)
        trainer.train()  # torchrun --nproc_per_node=8 sft.py
    """

    _public_name = "bmtwrap.hf.SFTTrainer"

    def __init__(self, *args: Any, wrap_options: Optional[Dict[str, Any]] = None,
                 offload: Union[bool, str] = "auto", **kwargs: Any) -> None:
        if wrap_options is None or isinstance(wrap_options, dict):  # anything else is refused by the mixin
            wrap_options = {"checkpoint": "auto", **(wrap_options or {})}
        _set_sharding_options(self, (*args, *kwargs.values()), wrap_options, offload)
        super().__init__(*args, **kwargs)


class DPOTrainer(trl.DPOTrainer, ShardedTrainerMixin):
    """TRL's ``DPOTrainer``, training a model sharded by bmtwrap (ZeRO-3).

    Takes every argument ``trl.DPOTrainer`` takes and behaves the same; underneath, what
    :class:`bmtwrap.hf.Trainer` changes (see its docstring) and [Note: TRL on a sharded model]
    in :mod:`bmtwrap.hf_trl`. The reference model (``ref_model=``, or the one TRL loads) is sharded
    like the model, frozen; with a peft model and no ``ref_model``, the reference is the sharded
    model with its adapters disabled. Import it as ``from bmtwrap.hf import DPOTrainer``.

    Args:
        *args: ``trl.DPOTrainer``'s arguments by position (``model``, ``ref_model``, ``args``, ...).
        wrap_options: keyword arguments for :func:`bmtwrap.wrap`, as for :class:`bmtwrap.hf.Trainer`;
            the reference model is wrapped with the same, less checkpointing.
        offload: the optimizer's choice, as for :class:`bmtwrap.hf.Trainer`.
        **kwargs: ``trl.DPOTrainer``'s arguments by name (``train_dataset``, ``peft_config``, ...).

    Raises:
        NotImplementedError: ``activation_offloading=True``, ``gradient_checkpointing_kwargs``
            with ``selective``, or a setting :class:`bmtwrap.hf.Trainer` refuses.

    Example::

        from trl import DPOConfig
        from bmtwrap.hf import DPOTrainer  # instead of: from trl import DPOTrainer

        trainer = DPOTrainer(model=model, args=DPOConfig("out"), train_dataset=pairs, processing_class=tokenizer)
        trainer.train()  # torchrun --nproc_per_node=8 dpo.py
    """

    _public_name = "bmtwrap.hf.DPOTrainer"

    def __init__(self, *args: Any, wrap_options: Optional[Dict[str, Any]] = None,
                 offload: Union[bool, str] = "auto", **kwargs: Any) -> None:
        _set_sharding_options(self, (*args, *kwargs.values()), wrap_options, offload)
        super().__init__(*args, **kwargs)
