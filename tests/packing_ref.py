"""The references the packing tests compare with: tiny models of each family, examples, and every
document of a packed batch run alone through the same model."""

from __future__ import annotations

import dataclasses
import random
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
import transformers

from bmtwrap.data import PackedBatch

VOCAB = 96
_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, _DECODER),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, _DECODER),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, _DECODER),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, dict(_DECODER, head_dim=8)),
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config,
             dict(n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)),
    # OPT offsets its learned positions by the attention mask, not by position_ids: packed, its
    # documents see each other, so packing refuses it.
    "opt": (transformers.OPTForCausalLM, transformers.OPTConfig,
            dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32)),
}


def tiny(family: str, attn: str = "sdpa") -> torch.nn.Module:
    """A tiny fp32 model of ``family`` (seeded), in training mode, dropout off."""
    model_cls, config_cls, options = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=64, **options)
    for name in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    config._attn_implementation = attn
    return model_cls(config).train()


def examples(count: int, *, seed: int, longest: int) -> List[Dict[str, List[int]]]:
    """``count`` examples of 1 to ``longest`` tokens; about a fifth of the labels -100 (prompt tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, longest))]
        out.append({"input_ids": ids, "labels": [t if rng.random() > 0.2 else -100 for t in ids]})
    return out


class Document(NamedTuple):
    row: int
    start: int
    end: int


def documents(position_ids: torch.Tensor) -> List[Document]:
    """The documents of packed rows, read from their positions (padding included: a document of its own)."""
    found = []
    for row, positions in enumerate(position_ids.tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        found += [Document(row, s, e) for s, e in zip(starts, starts[1:])]
    return found


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T-1) cross-entropy of each token predicting the next one's label; 0 where that label is -100."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), labels[:, 1:], ignore_index=-100, reduction="none")


def alone(model: torch.nn.Module, batch: PackedBatch,
          rows: Sequence[int]) -> Tuple[torch.Tensor, List[Tuple[Document, torch.Tensor]]]:
    """Every document of ``batch``'s ``rows`` run alone through ``model``: the sum of their token losses
    (with gradient) and each document's token losses. The padding is skipped (example tokens are never 0,
    the pad token)."""
    total, each = torch.zeros(()), []
    for doc in documents(batch.position_ids):
        doc_ids = batch.input_ids[doc.row : doc.row + 1, doc.start : doc.end]
        if doc.row not in rows or bool((doc_ids == 0).all()):
            continue
        doc_labels = batch.labels[doc.row : doc.row + 1, doc.start : doc.end]
        losses = token_losses(model(input_ids=doc_ids, use_cache=False).logits, doc_labels)[0]
        total = total + losses.sum()
        each.append((doc, losses.detach()))
    return total, each


def rows_of(batch: PackedBatch, rows: Sequence[int]) -> PackedBatch:
    """The batch cut down to ``rows`` (a rank's share)."""
    pick = list(rows)
    ids = batch.input_ids[pick]
    return dataclasses.replace(batch, input_ids=ids, labels=batch.labels[pick], position_ids=batch.position_ids[pick],
                               tokens=int((ids != 0).sum()))


def loss_count(batch: PackedBatch) -> int:
    """How many tokens a causal LM's loss averages over: the labels after the shift that are not -100."""
    return int((batch.labels[:, 1:] != -100).sum())


def token_loss_gap(model: torch.nn.Module, reference: torch.nn.Module, batch: PackedBatch,
                   positions: Optional[torch.Tensor] = None) -> float:
    """The largest difference between a token's loss in the packed forward of ``model`` and in its document
    run alone through ``reference`` (no gradients). ``positions``: given to ``model`` instead of the batch's
    (a control that must differ)."""
    with torch.no_grad():
        inputs = batch.model_inputs(model)
        del inputs["labels"]
        if positions is not None:
            inputs["position_ids"] = positions
        packed = token_losses(model(**inputs).logits, batch.labels)
        _, each = alone(reference, batch, range(batch.input_ids.shape[0]))
    assert each, "no documents"
    return max((packed[doc.row, doc.start : doc.end - 1] - losses).abs().max().item() if len(losses) else 0.0
               for doc, losses in each)
