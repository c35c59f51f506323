"""Hugging Face's ``Trainer`` on a model sharded by bmtwrap.

A Trainer script switches by one import: ``from bmtwrap.hf import Trainer`` instead of
``from transformers import Trainer``; its TrainingArguments, datasets, ``train()``,
``evaluate()``, ``save_model()`` and ``train(resume_from_checkpoint=...)`` stay as they are.

[Note: where Trainer is changed]
Trainer keeps everything it does well: the training loop, gradient accumulation, the loss
normalisation over ranks (``average_tokens_across_devices``), logging, callbacks, evaluation,
its RNG files, ``trainer_state.json`` and checkpoint rotation. accelerate keeps sharding the data
(each rank gets its own part of every global batch) and adding autocast for ``bf16``. Only what
meets the parameters changes:

- the model is sharded by :func:`bmtwrap.wrap` before Trainer sees it, and never wrapped again:
  :class:`_ShardedAccelerator` prepares it as accelerate prepares a model for evaluation
  (autocast, no DDP/FSDP, no ``.to()``), and ``_move_model_to_device`` leaves the shards where
  ``wrap`` put them; a second model prepared for evaluation only (TRL's DPO reference model) is
  sharded there, like the first, frozen;
- gradient clipping uses the norm over all shards (:func:`bmtwrap.optim.optim_manager.grad_norm`);
  ``torch.nn.utils.clip_grad_norm_`` on the shards would clip each rank by its own part's norm;
- the optimizer is bmtwrap's Adam(W), built from TrainingArguments with Trainer's own
  decay/no-decay split;
- a ``checkpoint-N`` folder holds one sharded checkpoint (model, optimizer, scheduler: every rank
  writes its own pieces) instead of the full weights and a rank-0 optimizer file, and resuming
  reads it back; ``save_model`` writes a folder plain transformers (or peft) loads.

The overrides touch these Trainer methods, the same in transformers 5.17 and 5.23: public
``create_accelerator_and_postprocess``, ``create_optimizer`` and ``save_model``; private
``_build_accelerator_args``, ``_move_model_to_device``, ``_save_checkpoint``,
``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``
and ``_load_best_model``. A transformers release that renames one of the private methods makes
its override dead code: the tests (same losses as plain Trainer, exact resume) catch that.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, NoReturn, Optional, Union

import torch
import transformers
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from transformers import PreTrainedModel, TrainingArguments

from .engine import dist as _dist
from .checkpoint import load_checkpoint, save, save_checkpoint, save_pretrained
from .checkpoint.sharded_format import INDEX
from .engine.full_state import full_state_dict
from .hf_limits import refuse_unsupported_args, refuse_unsupported_model
from .optim import AdamOffloadOptimizer, AdamOptimizer, auto_adam
from .optim.optim_manager import clip_grads_with_norm, grad_norm
from .wrap import wrap
from .wrap.convert import wrapped_record

# SFTTrainer, DPOTrainer and sharded are here too, from hf_trl on first use (see __getattr__ at the end): not in
# __all__, so that `from bmtwrap.hf import *` needs no trl.
__all__ = ["Trainer", "ShardedTrainerMixin"]

SHARDED_FOLDER = "bmtwrap"
"""The sub-folder of a ``checkpoint-N`` folder that holds the sharded checkpoint."""

# args.optim values that mean Adam with decoupled weight decay in full precision: the same
# update as bmtwrap's AdamOptimizer, whatever kernel transformers would have picked.
ADAMW_FAMILY = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused"})

_TRAINER_SIGNATURE = inspect.signature(transformers.Trainer.__init__)
_DEFAULT_DDP_TIMEOUT = next(f.default for f in dataclasses.fields(TrainingArguments) if f.name == "ddp_timeout")


def _uses_checkpointing(args: TrainingArguments) -> bool:
    # transformers 5.23 renamed gradient_checkpointing to activation_checkpointing and keeps both.
    return bool(getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing)


def _refuse_tensor_parallel(setting: str) -> NoReturn:
    raise NotImplementedError(
        f"{setting}: tensor parallelism needs the same batch on every rank of a tensor-parallel group, and Trainer "
        "(through accelerate) gives every rank its own; train a model wrapped with bmtwrap.wrap(model, tp_size=...) "
        "in a loop of your own instead")


def _wrap_options(args: TrainingArguments, wrap_options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``wrap_options`` with ``args.gradient_checkpointing`` taken as bmtwrap's checkpointing.

    Trainer would switch on Hugging Face's own checkpointing inside layers that bmtwrap already
    checkpoints as blocks; so the flag becomes ``wrap(checkpoint=True)`` and is switched off on
    ``args``.
    """
    if wrap_options is not None and not isinstance(wrap_options, dict):
        raise TypeError(f"wrap_options must be a dict of bmtwrap.wrap keyword arguments or None, got "
                        f"{type(wrap_options).__name__}")
    options = dict(wrap_options or {})
    known = set(inspect.signature(wrap).parameters) - {"model"}
    if not known.issuperset(options):
        raise TypeError(f"wrap_options has {sorted(set(options) - known)}, which bmtwrap.wrap does not take; it takes "
                        f"{sorted(known)}")
    if options.get("tp_size") not in (None, 1):
        _refuse_tensor_parallel(f"wrap_options={{'tp_size': {options['tp_size']!r}}}")
    if not _uses_checkpointing(args):
        return options
    if options.get("checkpoint", True) is False:
        raise ValueError("args.gradient_checkpointing=True asks for activation checkpointing but wrap_options has "
                         "checkpoint=False; drop one of them (bmtwrap checkpoints every block by default)")
    options.setdefault("checkpoint", True)
    args.gradient_checkpointing = False
    if hasattr(args, "activation_checkpointing"):
        args.activation_checkpointing = False
    return options


def _join(args: TrainingArguments) -> None:
    """Make Trainer's process group and bmtwrap's the same one, the default group.

    bmtwrap joins torchrun's job first (unless the program did), so that the group is made as
    bmtwrap makes it (and destroyed at exit); accelerate, setting up ``args.device``, finds the
    default group and adopts it. If accelerate made it first, bmtwrap adopts it.
    """
    if not _dist.is_initialized():
        backend = "gloo" if args.use_cpu else args.ddp_backend if args.ddp_backend in ("nccl", "gloo") else None
        # A group made before (by accelerate, from these arguments, or by the program) keeps its own timeout:
        # _warn_if_timeout_unused says so when it is not the one asked for.
        made = torch.distributed.is_initialized()
        _dist.init_distributed(seed=args.seed, backend=backend, timeout=None if made else args.ddp_timeout_delta)
    device = args.device  # accelerate's PartialState: adopts the default group
    ctx = _dist.current()
    _warn_if_timeout_unused(args, ctx)
    if ctx.tp_size > 1:
        _refuse_tensor_parallel(f"init_distributed(tp_size={ctx.tp_size})")
    if args.world_size != ctx.world_size:
        raise ValueError(f"TrainingArguments see {args.world_size} process(es) but the process group has "
                         f"{ctx.world_size} ranks: accelerate did not join the job. On a machine without GPUs pass "
                         "use_cpu=True to TrainingArguments")
    if device.type != ctx.device.type:
        raise ValueError(f"TrainingArguments put the batches on {device} but bmtwrap keeps the model on {ctx.device} "
                         "(bmtwrap.init_distributed was called before, with another backend?): pass use_cpu=True to "
                         "both, or to neither")
    if args.n_gpu > 1:
        raise NotImplementedError(f"args.n_gpu={args.n_gpu}: Trainer would run the model through "
                                  "torch.nn.DataParallel over the GPUs this process sees; bmtwrap runs one process per "
                                  f"GPU: launch with torchrun --nproc_per_node={args.n_gpu}")


def _warn_if_timeout_unused(args: TrainingArguments, ctx: _dist.DistContext) -> None:
    """Warn when the user set ``ddp_timeout`` and the process group has another timeout.

    ``ddp_timeout`` always has a value; only one that differs from TrainingArguments' default (30
    minutes, bmtwrap's default too) was asked for.
    """
    if args.ddp_timeout == _DEFAULT_DDP_TIMEOUT or args.ddp_timeout_delta == ctx.timeout:
        return
    warnings.warn(f"TrainingArguments(ddp_timeout={args.ddp_timeout}) has no effect: the process group was made "
                  f"before this Trainer, with a timeout of {ctx.timeout.total_seconds():g} s; pass the timeout to "
                  "what makes it (bmtwrap.init_distributed(timeout=...) or torch.distributed.init_process_group)",
                  stacklevel=4)  # the Trainer(...) call: _warn_if_timeout_unused <- _join <- __init__ <- caller


def _inner_optimizer(optimizer: Optional[torch.optim.Optimizer]) -> Optional[torch.optim.Optimizer]:
    """The optimizer itself, out of accelerate's wrapper (bmtwrap's checkpoints need its own class and wait())."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class _ShardedAccelerator(Accelerator):
    """accelerate's Accelerator for a model that bmtwrap has sharded.

    Data loaders, optimizers, autocast, gathering metrics and ``backward`` stay accelerate's.
    ``reference_wrap_options``: how a model prepared for evaluation only (TRL's reference model)
    is sharded; ``trainer_name`` names the trainer in the errors about it.
    """

    def __init__(self, *, reference_wrap_options: Dict[str, Any], trainer_name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reference_wrap_options = reference_wrap_options
        self.trainer_name = trainer_name

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> nn.Module:
        # bmtwrap placed every shard and averages the gradients over ranks itself: DDP or FSDP
        # would wrap (and .to() would move) what is already distributed. Prepared as accelerate
        # prepares a model for evaluation, it gets autocast (bf16) and nothing else.
        if wrapped_record(model) is None:
            # The trained model was wrapped when the Trainer was built; a model that comes unwrapped is one that
            # is only run (DPO's reference model, which TRL prepares with evaluation_mode=True). It is sharded
            # as the trained model is, frozen (no gradient buffers) and in eval mode, as TRL uses it.
            assert evaluation_mode, f"rank {self.process_index}: prepare_model got a model to train, not sharded"
            refuse_unsupported_model(model, None, f"{self.trainer_name} (its reference model)")
            model = wrap(model.requires_grad_(False).eval(), **self.reference_wrap_options)
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        # Each rank holds a shard of every gradient: the norm is over all of them
        # (torch.nn.utils.clip_grad_norm_ would clip each rank by its own shard's norm).
        # bmtwrap's optimizers apply the coefficient as they read the gradients (an offload optimizer may have
        # taken some off .grad already in backward): see clip_grads_with_norm.
        params = list(parameters)
        total = grad_norm(params, norm_type)
        if not math.isinf(max_norm):
            clip_grads_with_norm(params, max_norm, total, [_inner_optimizer(o) for o in self._optimizers])
        return total


def _check_place_in_mro(cls: type) -> None:
    """The mixin must sit right above ``transformers.Trainer``, so that every subclass has prepared the model
    before the mixin shards it, and its overrides are the last word before Trainer's own."""
    mro = cls.__mro__
    below = mro[mro.index(ShardedTrainerMixin) + 1]
    if below is not transformers.Trainer:
        raise TypeError(f"{cls.__name__} lists ShardedTrainerMixin before {below.__name__}: the mixin shards the model "
                        f"{below.__name__} prepares, so it goes last, right above transformers.Trainer: "
                        f"class {cls.__name__}({below.__name__}, ShardedTrainerMixin)")


class ShardedTrainerMixin(transformers.Trainer):
    """The behaviour of :class:`Trainer`, for any subclass of ``transformers.Trainer``.

    :class:`Trainer` is this mixin on ``transformers.Trainer`` itself; :class:`~bmtwrap.hf_trl.SFTTrainer`
    and :class:`~bmtwrap.hf_trl.DPOTrainer` put it under TRL's trainers. Another subclass of
    ``transformers.Trainer`` (a TRL trainer, or one of your own) gets it by listing the mixin last,
    so that it sits right above ``transformers.Trainer`` and shards the model that the subclass
    prepared (peft adapters added, loaded from a name)::

        class KTOTrainer(trl.KTOTrainer, ShardedTrainerMixin):
            pass

    :func:`bmtwrap.hf_trl.sharded` makes such a class that also takes ``wrap_options=`` and ``offload=``
    (``bmtwrap.hf.sharded(trl.KTOTrainer)``).

    The class docstring of :class:`Trainer` says what changes and what is refused.

    Raises:
        TypeError: the mixin is listed before another subclass of ``transformers.Trainer``.
    """

    _public_name = "bmtwrap.hf.ShardedTrainerMixin"  # names the trainer in error messages

    def __init__(self, model: Optional[nn.Module] = None, args: Optional[TrainingArguments] = None, *more: Any,
                 wrap_options: Optional[Dict[str, Any]] = None, offload: Union[bool, str] = "auto",
                 **kwargs: Any) -> None:
        _check_place_in_mro(type(self))
        # A TRL trainer passes on to here only transformers.Trainer's arguments: its own __init__ (see
        # bmtwrap.hf_trl) keeps the sharding options aside until then.
        wrap_options, offload = self.__dict__.pop("_sharding_options", (wrap_options, offload))
        who = self._public_name
        given = _TRAINER_SIGNATURE.bind(self, model, args, *more, **kwargs).arguments
        del given["self"]
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")
        refuse_unsupported_args(args, who)
        model = refuse_unsupported_model(model, given.get("model_init"), who)
        self._check_optimizer_choice(args, given, offload)
        options = _wrap_options(args, wrap_options)
        _join(args)
        self._offload = offload
        # A reference model (TRL's DPO) is sharded as the model is, never checkpointed: it runs without gradients.
        self._reference_wrap_options = {**options, "checkpoint": False}
        # True while Trainer writes a checkpoint-N folder (see _save_checkpoint).
        self._writing_checkpoint = False
        super().__init__(**{**given, "model": wrap(model, **options), "args": args})

    @staticmethod
    def _check_optimizer_choice(args: TrainingArguments, given: Dict[str, Any], offload: Union[bool, str]) -> None:
        if not isinstance(offload, bool) and offload != "auto":
            raise ValueError(f"offload must be True, False or 'auto', got {offload!r}")
        optimizer = given.get("optimizers", (None, None))[0]
        if optimizer is not None or given.get("optimizer_cls_and_kwargs") is not None:
            if offload is True:
                raise ValueError("offload=True chooses the optimizer bmtwrap.hf.Trainer builds, but optimizers= or "
                                 "optimizer_cls_and_kwargs= chose another: pass bmtwrap.optim.AdamOffloadOptimizer "
                                 "there, or drop offload")
            return
        optim = str(getattr(args.optim, "value", args.optim))
        if optim not in ADAMW_FAMILY:
            raise ValueError(f"args.optim={optim!r}: bmtwrap.hf.Trainer builds bmtwrap's Adam(W) for "
                             f"{sorted(ADAMW_FAMILY)}; for another optimizer pass optimizer_cls_and_kwargs=(cls, "
                             "kwargs) or optimizers=(optimizer, lr_scheduler), built on the model's parameters")

    # --- the accelerator --------------------------------------------------------------------

    def _build_accelerator_args(self, **kwargs: Any) -> Dict[str, Any]:
        # Kept so that create_accelerator_and_postprocess builds _ShardedAccelerator from exactly
        # what Trainer derived from TrainingArguments (data loader, accumulation, autocast, ...).
        self._accelerator_kwargs = super()._build_accelerator_args(**kwargs)
        return self._accelerator_kwargs

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's Accelerator set-up, with the accelerator replaced by one for sharded models.

        Trainer builds accelerate's ``Accelerator`` (by a name this subclass cannot change) and
        checks its settings; the same keyword arguments then build :class:`_ShardedAccelerator`.

        Raises:
            NotImplementedError: accelerate was configured for DeepSpeed or FSDP (``accelerate
                launch`` with such a config).
        """
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise NotImplementedError("accelerate is configured for DeepSpeed or FSDP (an accelerate launch config?); "
                                      "bmtwrap shards the model itself: launch with torchrun, or with an accelerate "
                                      "config of plain multi-GPU/CPU")
        self.accelerator = _ShardedAccelerator(reference_wrap_options=self._reference_wrap_options,
                                               trainer_name=self._public_name, **self._accelerator_kwargs)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(self.gather_function,
                                                     use_gather_object=self.args.eval_use_gather_object)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # wrap() put every shard where it lives (the device, or the host with offload_params);
        # model.to() would move offloaded shards and replace the flat buffers' views.
        pass

    # --- the optimizer ----------------------------------------------------------------------

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """bmtwrap's Adam(W) from TrainingArguments, with Trainer's weight-decay split.

        ``optimizers=`` or ``optimizer_cls_and_kwargs=`` given to the Trainer are honoured as
        ``transformers.Trainer`` honours them.

        Args:
            model: the model whose trainable parameters to optimize; default ``self.model``.

        Returns:
            The optimizer (also stored as ``self.optimizer``).

        Example::

            trainer.create_optimizer()  # as train() does; then e.g. inspect trainer.optimizer.param_groups
        """
        if self.optimizer is not None or self.optimizer_cls_and_kwargs is not None:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        trainable = [(name, p) for name, p in opt_model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for name, p in trainable if name in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for name, p in trainable if name not in decay], "weight_decay": 0.0}]
        make = {True: AdamOffloadOptimizer, False: AdamOptimizer, "auto": auto_adam}[self._offload]
        self.optimizer = make([g for g in groups if g["params"]], lr=self.args.learning_rate,
                              betas=(self.args.adam_beta1, self.args.adam_beta2), eps=self.args.adam_epsilon)
        return self.optimizer

    # --- saving -----------------------------------------------------------------------------

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        # Trainer writes a checkpoint-N folder through save_model (the weights),
        # _save_optimizer_and_scheduler, its RNG files and trainer_state.json, then rotates. One
        # sharded checkpoint holds the weights with the optimizer and scheduler state, so while
        # this folder is written, save_model writes that checkpoint, and
        # _save_optimizer_and_scheduler has nothing left to write.
        self._writing_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._writing_checkpoint = False

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Write the model to ``output_dir`` (default ``args.output_dir``), as transformers or peft loads it.

        A collective: call it on every rank. A transformers model is written by
        :func:`bmtwrap.save_pretrained` (rank 0 writes; the folder is swapped in whole, keeping
        its other files); a peft model's adapters are gathered to full size and written in peft's
        format; any other model as ``model.safetensors`` (:func:`bmtwrap.save`). Rank 0 also writes
        the processing class (tokenizer) and ``training_args.bin``. Every rank returns once the
        folder is complete. While Trainer writes a ``checkpoint-N`` folder, the sharded checkpoint
        is written instead (see the class docstring).

        Args:
            output_dir: the folder; default ``args.output_dir``.
            _internal_call: Trainer's flag: ``False`` pushes to the Hub when ``args.push_to_hub``.

        Example::

            trainer.save_model("out/final")
            model = AutoModelForCausalLM.from_pretrained("out/final")  # anywhere, without bmtwrap
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self._writing_checkpoint:
            self._save_sharded(Path(output_dir))
        else:
            self._save_full(Path(output_dir))
        if self.args.should_save:
            self._save_beside_model(Path(output_dir))
        _dist.synchronize()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_sharded(self, folder: Path) -> None:
        if self.args.save_only_model:
            save_checkpoint(folder / SHARDED_FOLDER, self.model, step=self.state.global_step)
        else:
            save_checkpoint(folder / SHARDED_FOLDER, self.model, _inner_optimizer(self.optimizer), self.lr_scheduler,
                            step=self.state.global_step)

    def _save_full(self, folder: Path) -> None:
        if _is_peft_model(self.model):
            self._save_adapters(folder)
        elif isinstance(self.model, PreTrainedModel):
            save_pretrained(self.model, folder)
        else:
            folder.mkdir(parents=True, exist_ok=True)
            save(self.model, folder / "model.safetensors")

    def _save_adapters(self, folder: Path) -> None:
        """Gather the adapters (only the flat buffers holding them) and write them as peft does."""
        model = self.model
        adapters = set(model.peft_config)
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        state = full_state_dict(model, select=lambda key: key in trainable or not adapters.isdisjoint(key.split(".")))
        if self.args.should_save:
            model.save_pretrained(str(folder), state_dict={k: v.cpu() for k, v in state.items()})

    def _save_beside_model(self, folder: Path) -> None:
        # As Trainer's _save: the tokenizer (or processor) and the arguments, next to the weights.
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer = self.processing_class
        if tokenizer is None:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(folder))
        torch.save(self.args, folder / transformers.trainer.TRAINING_ARGS_NAME)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Written with the model, in one sharded checkpoint, by save_model (see _save_checkpoint).
        pass

    # --- resuming ---------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        # Trainer loads the weights here, before the optimizer exists; the sharded checkpoint
        # holds both and is read once, in _load_optimizer_and_scheduler. Checked now, before
        # anything is built.
        if not (Path(resume_from_checkpoint) / SHARDED_FOLDER / INDEX).is_file():
            raise ValueError(f"{resume_from_checkpoint} holds no bmtwrap checkpoint ({SHARDED_FOLDER}/{INDEX}): resume "
                             "from a checkpoint-N folder bmtwrap.hf.Trainer wrote; to start from a Hugging Face "
                             "folder, load the model from it before building the Trainer")

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        # Model, optimizer and scheduler together, each rank reading its own pieces (at any world size).
        if checkpoint is not None:
            load_checkpoint(Path(checkpoint) / SHARDED_FOLDER, self.model, _inner_optimizer(self.optimizer),
                            self.lr_scheduler)

    def _load_best_model(self) -> None:
        # The weights of the best checkpoint-N folder are in its sharded checkpoint.
        load_checkpoint(Path(self.state.best_model_checkpoint) / SHARDED_FOLDER, self.model)


class Trainer(ShardedTrainerMixin):
    """Hugging Face's ``transformers.Trainer``, training a model sharded by bmtwrap (ZeRO-3).

    Takes every argument ``transformers.Trainer`` takes and behaves the same; see
    [Note: where Trainer is changed] in this module for what differs underneath. Launch with
    ``torchrun --nproc_per_node=N script.py`` (on a machine without GPUs, with ``use_cpu=True`` in
    TrainingArguments); ``python script.py`` trains in one process.

    - The model is sharded by :func:`bmtwrap.wrap` when the Trainer is built (joining the process
      group first, with :func:`bmtwrap.init_distributed` if it was not called); Trainer and
      accelerate use the same default process group, and accelerate still gives each rank its own
      share of every global batch. The model is never wrapped in DDP, DataParallel or FSDP.
    - The optimizer is :func:`bmtwrap.optim.auto_adam`'s choice (:class:`bmtwrap.optim.AdamOptimizer`;
      :class:`bmtwrap.optim.AdamOffloadOptimizer` with ``offload_fraction="auto"`` when
      ``wrap_options`` set ``max_gpu_memory`` or the parameters were offloaded; with ``offload=True``,
      :class:`bmtwrap.optim.AdamOffloadOptimizer`, all state on the host) with ``learning_rate``, ``adam_beta1``,
      ``adam_beta2``, ``adam_epsilon`` and ``weight_decay`` from TrainingArguments and Trainer's
      decay/no-decay parameter split; ``args.optim`` must name full-precision AdamW
      (:data:`ADAMW_FAMILY`, Trainer's default among them), unless ``optimizers=`` or
      ``optimizer_cls_and_kwargs=`` choose the optimizer.
    - ``max_grad_norm`` clips by the norm of the whole gradient, over all shards.
    - ``args.gradient_checkpointing=True`` (``activation_checkpointing`` in newer transformers)
      means ``wrap(checkpoint=True)``: bmtwrap recomputes each block in backward (without the
      flag, ``wrap``'s default ``checkpoint="auto"`` keeps what fits). The flag is switched off on
      ``args``, so Hugging Face's own checkpointing is not added on top; its kwargs
      (``use_reentrant``, ...) are not used.
    - A ``checkpoint-N`` folder holds, beside Trainer's ``trainer_state.json`` and RNG files, a
      sharded checkpoint in ``checkpoint-N/bmtwrap/`` (:func:`bmtwrap.save_checkpoint`: model,
      optimizer and scheduler, every rank writing its own pieces) instead of the full weights;
      ``train(resume_from_checkpoint=...)`` reads it back (at this or another world size); at the
      same world size, training continues exactly as the uninterrupted run would have.
      ``save_total_limit`` and ``load_best_model_at_end`` work on these folders. A checkpoint
      saved with ``save_only_model=True`` holds no optimizer state and cannot be resumed (as with
      plain Trainer).
    - ``save_model(dir)`` (call it on every rank) writes a folder that plain transformers loads
      (:func:`bmtwrap.save_pretrained`); for a peft model, the adapters in peft's format, gathered
      to full size, for ``PeftModel.from_pretrained``; for another ``nn.Module``,
      ``model.safetensors`` with the unwrapped model's keys. The tokenizer (processing class) and
      ``training_args.bin`` are written beside, as Trainer does.
    - ``evaluate()`` and ``predict()`` run on every rank (the forward is a collective) and gather
      as Trainer does; ``trainer.model.generate()`` works when called on every rank.
    - ``ddp_timeout`` is the process group's timeout where this Trainer (or accelerate, from the
      same arguments) makes the group; a group made before keeps its own, with a warning when
      ``ddp_timeout`` was set to another.

    Args:
        model: the model to train: a transformers ``PreTrainedModel``, a peft model built on one,
            or any ``nn.Module`` that returns a loss; on the CPU (or this rank's GPU), every rank
            holding the same weights. It is sharded in place; an already wrapped model is used as
            it is (wrapping again with other options raises).
        args: as ``transformers.Trainer``; default ``TrainingArguments(output_dir="tmp_trainer")``.
        *more: the other arguments of ``transformers.Trainer`` given by position, in its order
            (``data_collator``, ``train_dataset``, ``eval_dataset``, ``processing_class``, ...).
        wrap_options: keyword arguments for :func:`bmtwrap.wrap` (``checkpoint``,
            ``zero_level``, ``offload_params``, ``layers``, ...); default: wrap's defaults.
        offload: ``True``: build :class:`bmtwrap.optim.AdamOffloadOptimizer` (fp32 master and moments in
            CPU memory); ``False``: :class:`bmtwrap.optim.AdamOptimizer`; ``"auto"`` (default):
            :func:`bmtwrap.optim.auto_adam` decides from ``wrap_options``' memory options.
        **kwargs: the other arguments of ``transformers.Trainer`` by name (``train_dataset``,
            ``eval_dataset``, ``processing_class``, ``compute_metrics``, ``callbacks``,
            ``optimizers``, ``optimizer_cls_and_kwargs``, ...).

    Raises:
        NotImplementedError: a setting bmtwrap cannot train with, named with what to use instead:
            ``deepspeed``, ``fsdp``/``fsdp_config`` (or an ``accelerate launch`` config with either),
            ``fp16`` (use ``bf16``), ``fp16_full_eval``/``bf16_full_eval``, ``torch_compile``,
            ``auto_find_batch_size``, ``use_liger_kernel``, ``even_batches=False``,
            ``parallelism_config``, tensor parallelism (``wrap_options={"tp_size": N}`` or
            ``init_distributed(tp_size=N)``), ``model_init``, more than one GPU per process (DataParallel),
            models loaded with a multi-device ``device_map``, quantized or already distributed by
            transformers.
        ValueError: ``args.optim`` outside the AdamW family without ``optimizers=`` or
            ``optimizer_cls_and_kwargs=``; ``offload=True`` with ``optimizers=`` or
            ``optimizer_cls_and_kwargs=``; ``gradient_checkpointing=True`` with
            ``wrap_options={"checkpoint": False}``; TrainingArguments seeing another number of
            processes than the process group (on a machine without GPUs, ``use_cpu=True`` is
            needed under torchrun), or another device type than bmtwrap's; no ``model``.
        TypeError: ``wrap_options`` is not a dict, or holds an argument ``wrap`` does not take.

    Example::

        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments
        from bmtwrap.hf import Trainer  # the one changed line

        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        args = TrainingArguments("out", per_device_train_batch_size=4, bf16=True, save_steps=500)
        trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()                 # torchrun --nproc_per_node=8 finetune.py
        trainer.save_model("out/final")  # AutoModelForCausalLM.from_pretrained("out/final") loads it
    """

    _public_name = "bmtwrap.hf.Trainer"


def __getattr__(name: str) -> Any:
    # TRL's trainers on a sharded model come from bmtwrap.hf_trl, imported on first use: `import bmtwrap.hf`
    # does not need trl.
    if name in ("SFTTrainer", "DPOTrainer", "sharded"):
        from . import hf_trl

        return getattr(hf_trl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
