"""A batch of examples of different lengths, padded on the right to one length."""

from __future__ import annotations

from typing import List, Mapping, NamedTuple, Optional, Sequence

import torch

from .tokenize import IGNORE_INDEX


class PaddedBatch(NamedTuple):
    """The tensors a causal LM takes, and how many of their tokens are padding."""

    input_ids: torch.Tensor  # (B, T), pad_id on padding
    labels: torch.Tensor  # (B, T), IGNORE_INDEX on padding
    attention_mask: torch.Tensor  # (B, T), 1 on the examples' tokens, 0 on padding
    padding: int  # padding tokens in the batch


def pad_examples(examples: Sequence[Mapping[str, List[int]]], pad_id: int, *,
                 length: Optional[int] = None) -> PaddedBatch:
    """Examples padded on the right to the longest of them, or to ``length``.

    On the right, the examples' tokens keep positions 0, 1, ...: a causal model computes them exactly
    as it would unpadded, and the padding after them is neither attended to nor learnt.

    Raises:
        ValueError: no example, or one longer than ``length``.
    """
    if not examples:
        raise ValueError("pad_examples needs at least one example")
    longest = max(len(e["input_ids"]) for e in examples)
    width = longest if length is None else length
    if longest > width:
        raise ValueError(f"an example of {longest} tokens is longer than length={length}")
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        ids[row, :n] = torch.tensor(example["input_ids"], dtype=torch.long)
        labels[row, :n] = torch.tensor(example["labels"], dtype=torch.long)
        mask[row, :n] = 1
    return PaddedBatch(ids, labels, mask, int(mask.numel() - mask.sum()))
