"""A causal LM's training loss computed from its last hidden state, without the logits.

[Note: the loss without the logits]
Transformers computes a causal LM's loss from the full logits, upcast to fp32: at a 128k
vocabulary and 8192 tokens that is 4 GiB of fp32 logits, and as much again for each of the
log-probabilities and their gradient in backward, more than a whole layer's activations. When a
wrapped model is called in training mode, with gradients, and with ``labels``:

- a forward pre-hook takes ``labels`` out of the call (so transformers computes no loss) and
  remembers them with the loss options transformers would read from the call's keyword arguments
  (``shift_labels``, ``ignore_index``, ``num_items_in_batch``);
- the output projection (``get_output_embeddings()``, an ``nn.Linear`` without bias) computes the
  loss from its input with :func:`bmtwrap.loss.linear_cross_entropy`, in chunks of rows, and
  returns an empty ``(batch, seq, 0)`` tensor in place of the logits (what the model does to the
  logits next, Gemma's soft-capping, costs nothing on it; the cap is applied inside the loss);
- a forward hook sets the output's ``loss`` and leaves ``logits=None``.

The labels are shifted and ignored as transformers' ``ForCausalLMLoss`` does: ``labels[..., 1:]``
padded with ``ignore_index`` (or ``shift_labels`` as given), the mean over the counted tokens, or
the sum divided by ``num_items_in_batch`` when the caller (the Trainer) passes it. One difference:
when every label is ignored the loss is 0, not transformers' NaN.

Under tensor parallelism (``wrap(tp_size=T)``) every rank of a group holds the group's whole batch and
the whole head (the plan keeps the LM head whole); rather than each computing the same loss, each
computes the sum over its ``1/T`` of the rows (``tp.own_rows``, whose backward gathers the rows'
gradients), the group adds the sums, and the head's gradient is summed over the group (``tp.copy_whole``):
the same loss and gradients, a ``T``-th of the work each (rows that do not divide by ``T``: the whole on
every rank, as before).

Only models known to feed the projection's output straight into ``ForCausalLMLoss`` take this
path (``FUSED_MODEL_TYPES``, and a forward defined by transformers itself, not a subclass's);
others, calls in evaluation mode or without gradients (``generate``), ``wrap(keep_logits=True)``,
labels passed positionally, ``logits_to_keep`` or ``return_dict=False`` get transformers' own loss
and logits; a call with ``fused_lm_head=True`` (TRL's trainers, which compute the log-probabilities
from the hidden states themselves) keeps its labels.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..engine import dist as _dist
from ..engine import tp
from ..engine.schedule import engine
from ..loss import linear_cross_entropy
from .instance_forward import replace_forward

__all__ = ["FUSED_MODEL_TYPES", "covered_head", "install_head_loss"]

# Model types (``config.model_type``) whose causal-LM forward computes ``loss_function(lm_head(hidden), labels)``
# with the projection's output unchanged but for Gemma 2/3's soft-capping (``final_logit_softcapping``).
FUSED_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "gpt2", "phi", "phi3", "olmo", "olmo2", "starcoder2", "gpt_neox", "smollm3", "stablelm",
})


@dataclass
class _Pending:
    """One call's labels and loss options, until the projection computes the loss."""

    labels: torch.Tensor
    shift_labels: Optional[torch.Tensor]
    ignore_index: int
    num_items_in_batch: Any
    loss: Optional[torch.Tensor] = None


class _HeadLoss:
    """The hooks of one model (see [Note: the loss without the logits])."""

    def __init__(self, hf: nn.Module, head: nn.Linear) -> None:
        self.hf = hf
        self.head = head
        self.softcap = getattr(hf.config, "final_logit_softcapping", None)
        self.pending: List[Optional[_Pending]] = []  # per call of hf.forward, innermost last
        # Under tensor parallelism with the head whole, each rank of a group computes its rows' share of the loss.
        self.tp_group_splits = _whole_head_in_tp_group(head)

    def before(self, module: nn.Module, args: Tuple[Any, ...],
               kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        labels = kwargs.get("labels")
        if not (module.training and self._applies(labels, kwargs)):
            self.pending.append(None)
            return None
        kwargs = dict(kwargs, labels=None)
        self.pending.append(_Pending(labels, kwargs.get("shift_labels"), kwargs.get("ignore_index", -100),
                                     kwargs.get("num_items_in_batch")))
        return args, kwargs

    def _applies(self, labels: Any, kwargs: Dict[str, Any]) -> bool:
        # fused_lm_head=True: TRL's forward (trl.trainer.utils.add_fused_lm_head) computes the log-probabilities
        # from the hidden states and lm_head.weight itself, without the logits, and needs the labels to do it.
        return (isinstance(labels, torch.Tensor) and torch.is_grad_enabled() and not kwargs.get("fused_lm_head")
                and not kwargs.get("logits_to_keep") and kwargs.get("return_dict") is not False)

    def after(self, module: nn.Module, args: Any, kwargs: Dict[str, Any], output: Any) -> Any:
        pending = self.pending.pop() if self.pending else None
        if pending is None or output is None:  # output is None: the forward raised
            return None
        if pending.loss is None:
            raise RuntimeError(f"{type(module).__name__}'s forward did not call its output projection "
                               f"({type(self.head).__name__}); pass keep_logits=True to bmtwrap.wrap")
        # A new output without the logits' key: ModelOutput keeps a key it once had even when set to None.
        fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
        return type(output)(loss=pending.loss, **fields)

    def project(self, original: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        pending = self.pending[-1] if self.pending else None
        if pending is None or pending.loss is not None or hidden.dim() < 2:
            return original(hidden)
        pending.loss = self._loss(hidden, pending)
        return hidden.new_empty(*hidden.shape[:-1], 0)

    def _loss(self, hidden: torch.Tensor, pending: _Pending) -> torch.Tensor:
        targets = pending.shift_labels
        if targets is None:  # tokens < n predict n
            targets = F.pad(pending.labels, (0, 1), value=pending.ignore_index)[..., 1:]
        targets = targets.reshape(-1).to(hidden.device)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if targets.shape[0] != flat.shape[0]:
            raise ValueError(f"labels hold {targets.shape[0]} tokens but the model's last hidden state "
                             f"{flat.shape[0]}: give labels the shape of input_ids")
        total = pending.num_items_in_batch
        if self.tp_group_splits and flat.shape[0] % _dist.current().tp_size == 0:
            # Every rank of a tensor-parallel group holds the group's whole batch and the whole head: each
            # computes its rows' share of the sum, and the group adds them (see [Note: the loss without the
            # logits]).
            counted = (targets != pending.ignore_index).sum() if total is None else None
            loss = linear_cross_entropy(tp.own_rows(flat), tp.copy_whole(self.head.weight), tp.own_rows(targets),
                                        ignore_index=pending.ignore_index, reduction="sum", softcap=self.softcap)
            loss = tp.all_reduce_whole(loss)
            total = counted.clamp(min=1) if total is None else total
        else:
            loss = linear_cross_entropy(flat, self.head.weight, targets, ignore_index=pending.ignore_index,
                                        reduction="mean" if total is None else "sum", softcap=self.softcap)
        if total is not None:
            loss = loss / (total.to(loss.device) if torch.is_tensor(total) else total)
        return loss


def _whole_head_in_tp_group(head: nn.Linear) -> bool:
    """Whether the model computes in tensor-parallel groups with ``head`` whole on every rank of a group (the plan
    kept it whole); asked when the hooks are installed, while ``head.weight`` is the sharded parameter itself."""
    if not _dist.is_initialized() or _dist.current().tp_size == 1:
        return False
    registry = engine().registry
    return (registry.is_sharded(head.weight)
            and registry.slot_of(_dist.current(), head.weight)[1].tp_split_dim is None)


def _projection(hf: nn.Module) -> Optional[nn.Linear]:
    get = getattr(hf, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    return head


def _qualifies(hf: nn.Module) -> bool:
    config = getattr(hf, "config", None)
    forward = getattr(type(hf), "forward", None)
    return (getattr(config, "model_type", None) in FUSED_MODEL_TYPES
            and getattr(forward, "__module__", "").startswith("transformers.models.")
            and "labels" in inspect.signature(hf.forward).parameters
            and getattr(getattr(hf, "loss_function", None), "__name__", None) == "ForCausalLMLoss")


def covered_head(hf: nn.Module) -> Optional[nn.Linear]:
    """The output projection through which ``hf``'s loss is computed without logits, or ``None`` when ``hf`` is
    not one of the causal LMs this covers."""
    head = _projection(hf)
    return head if head is not None and _qualifies(hf) else None


def install_head_loss(hf: nn.Module) -> Tuple[List[RemovableHandle], Optional[Callable[[], None]]]:
    """Compute ``hf``'s loss without its logits when it trains with labels (see [Note: the loss without the
    logits]). Returns the hooks' handles and what restores the projection's forward (``None``: not installed,
    the model is not one of the known causal LMs)."""
    head = covered_head(hf)
    if head is None:
        return [], None
    loss = _HeadLoss(hf, head)
    original = head.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return loss.project(original, hidden)

    restore = replace_forward(head, forward)
    handles = [hf.register_forward_pre_hook(loss.before, with_kwargs=True),
               hf.register_forward_hook(loss.after, with_kwargs=True, always_call=True)]
    return handles, restore
