"""Packing many short examples into full rows, without cross-talk between them.

[Note: packing without cross-talk]
A row of ``seq`` tokens holds several documents (tokenized examples) one after another, then padding.
Three things keep each document what it would be alone:

- ``position_ids`` restart at 0 at every document (and at the padding, which is a document of its own),
  so rotary or absolute position embeddings see the document's own positions.
- The attention is block-diagonal: a token attends to the earlier tokens of its own document only.
  Hugging Face models (transformers 5.x) build this themselves from the restarting ``position_ids``
  when they get no ``attention_mask`` and no key/value cache: ``masking_utils.create_causal_mask``
  finds the documents (``find_packed_sequence_indices``: a new document wherever a position is not the
  previous one plus 1) and builds the block-diagonal causal mask for ``eager`` and ``sdpa``;
  ``_flash_attention_forward`` runs the varlen kernel on documents found from ``position_ids``, but
  only for a batch of one row, so for flash attention the rows are joined into one
  (:meth:`PackedBatch.model_inputs`). A cache disables the detection: a model called with its config's
  default ``use_cache=True`` makes a ``DynamicCache`` even in training and silently attends across
  documents, so ``model_inputs`` passes ``use_cache=False``.
- ``labels`` are -100 on each document's first token: a causal LM's loss at token ``t`` predicts
  ``labels[t + 1]``, and the last token of one document must not be trained to predict the next
  document's first token. (Alone, a document's first label is never used either.)

The mask is built once per forward outside the layers and handed to every layer as an argument, with
``position_ids``; ``bmtwrap.wrap``'s blocks pass every argument through unchanged, checkpointed or
compiled, so a wrapped model packs as the plain one does (tests/test_packing.py checks both).

Rows are filled by first-fit decreasing over a buffer of examples shuffled with a seeded generator:
the same examples and seed give the same batches.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Dict, Generator, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["PACKING_FAMILIES", "PackedBatch", "Packer", "PaddingShare", "check_packing", "first_fit_decreasing",
           "packed_inputs"]

IGNORE_INDEX = -100
_Example = Tuple[List[int], List[int]]  # (input_ids, labels), checked

# Model types whose transformers 5.x implementation builds its attention mask with masking_utils from
# position_ids and embeds the positions it is given: checked against documents run one by one in
# tests/test_packing.py. Another family may attend across documents (or ignore position_ids), so it
# is refused rather than trusted.
PACKING_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2"})
# Attention implementations that honour the documents: the two that build a dense mask, and flash
# attention's varlen path (rows joined into one).
_MASKED = frozenset({"eager", "sdpa"})
_VARLEN = frozenset({"flash_attention_2", "flash_attention_3"})


def first_fit_decreasing(lengths: Sequence[int], seq: int) -> List[List[int]]:
    """Bin-pack ``lengths`` into rows of at most ``seq`` tokens; returns each row's indices into ``lengths``.

    Longest first (ties in index order), each into the first row with room, a new row when none has:
    rows come out fullest first. Deterministic.

    Raises:
        ValueError: a length is below 1 or above ``seq``.
    """
    rows: List[List[int]] = []
    room: List[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if not 1 <= length <= seq:
            raise ValueError(f"length {length} at index {index} does not fit a row of seq={seq} tokens")
        row = next((r for r, free in enumerate(room) if free >= length), len(rows))
        if row == len(rows):
            rows.append([])
            room.append(seq)
        rows[row].append(index)
        room[row] -= length
    return rows


@dataclasses.dataclass(frozen=True)
class PaddingShare:
    """The share of padding tokens among all tokens of the batches, with and without packing.

    Attributes:
        packed: in the packed rows (``rows x seq`` tokens a batch, the last batch possibly fewer rows).
        unpacked: one example a row, padded to the longest of its batch (what a padding collator
            gives), the examples in the order they came, as many a batch as fit the packed batch's
            ``rows x seq`` tokens (the same memory a step).
    """

    packed: float
    unpacked: float


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One batch of packed rows; every tensor is ``(rows, seq)``, int64, on the CPU.

    Attributes:
        input_ids: the documents' tokens one after another, then ``pad_token_id``.
        labels: the documents' labels, -100 on each document's first token and on the padding.
        position_ids: 0, 1, ... within each document, and again from 0 over the padding.
        documents: how many documents the batch holds.
        tokens: how many of its tokens are not padding.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    documents: int
    tokens: int

    def model_inputs(self, model: nn.Module, device: Optional[torch.device] = None) -> Dict[str, Any]:
        """The keyword arguments for ``model(**...)``: ``input_ids``, ``labels``, ``position_ids``, ``use_cache=False``.

        No ``attention_mask``: the model builds the per-document mask from ``position_ids`` (an
        attention mask, or a cache, would turn that off). For flash attention the rows are joined
        into one row, the only shape whose documents its varlen path finds; the loss is the same, as
        every row starts with a token whose label is -100.

        Args:
            model: the model the batch is for (wrapped by ``bmtwrap.wrap`` or not, inside peft or not).
            device: where to move the tensors; ``None`` leaves them on the CPU.

        Raises:
            NotImplementedError: the model's family or attention implementation is not known to
                honour packed documents (see :func:`check_packing`).
        """
        return packed_inputs(model, device, input_ids=self.input_ids, labels=self.labels,
                             position_ids=self.position_ids)


def packed_inputs(model: nn.Module, device: Optional[torch.device] = None, **rows: torch.Tensor) -> Dict[str, Any]:
    """Packed rows (``input_ids``, ``labels``, ``position_ids``, each ``(rows, seq)``) as ``model(**...)`` takes them.

    What :meth:`PackedBatch.model_inputs` returns, for rows packed by other code: no attention mask,
    ``use_cache=False``, and for flash attention the rows joined into one (each row must start a
    document whose first label is -100, as :class:`Packer`'s do, so the loss is unchanged).

    Raises:
        NotImplementedError: as :func:`check_packing`.
    """
    if "position_ids" not in rows:
        raise TypeError("packed_inputs needs position_ids: they are what keeps the packed documents apart")
    if check_packing(model) in _VARLEN:
        rows = {name: t.reshape(1, -1) for name, t in rows.items()}
    return {**{name: t.to(device) for name, t in rows.items()}, "use_cache": False}


def check_packing(model: nn.Module) -> str:
    """Check that ``model`` keeps packed documents apart; returns its attention implementation.

    Supported: Hugging Face models of the types in ``PACKING_FAMILIES`` (Llama, Mistral, Qwen2,
    Qwen3, GPT-2) with ``eager``, ``sdpa``, ``flash_attention_2`` or ``flash_attention_3`` attention,
    wrapped by ``bmtwrap.wrap`` or not, inside a peft model or not.

    Raises:
        NotImplementedError: the model is not a Hugging Face model, or its type or attention
            implementation is not one of those; packing it would let documents attend to each other.
    """
    hf = next((m for m in model.modules() if _is_hf_model(m)), None)
    if hf is None:
        raise NotImplementedError(
            f"packing needs a Hugging Face model that builds its attention mask from position_ids; "
            f"{type(model).__name__} is not one. Pass one document per row (with padding) instead, or "
            f"build the block-diagonal mask in your model")
    config = hf.config
    model_type = getattr(config, "model_type", None)
    if model_type not in PACKING_FAMILIES:
        raise NotImplementedError(
            f"packing is not supported for model type {model_type!r} ({type(hf).__name__}): it is checked only "
            f"for {', '.join(sorted(PACKING_FAMILIES))}, whose attention keeps packed documents apart. "
            f"Train this model on unpacked batches (one example a row, padded)")
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in _MASKED | _VARLEN:
        raise NotImplementedError(
            f"packing is not supported with attn_implementation={implementation!r}: it is checked only for "
            f"{', '.join(sorted(_MASKED | _VARLEN))}. Load the model with attn_implementation='sdpa'")
    return implementation


def _is_hf_model(module: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
               for cls in type(module).__mro__)


class Packer:
    """Packs tokenized examples into batches of ``rows`` rows of exactly ``seq`` tokens.

    Examples are read ``buffer_size`` at a time, shuffled (seeded), and packed by first-fit
    decreasing (:func:`first_fit_decreasing`); the rows of full batches are shuffled into batches,
    and the examples of the rows left over (the emptiest ones) go back into the next buffer. The
    last batch may have fewer rows. The same examples, options and seed give the same batches.

    Args:
        seq: tokens in a row (the model's training length).
        rows: rows in a batch.
        seed: the shuffling's seed.
        buffer_size: examples packed together; more packs tighter (padding falls) but holds more in
            memory and mixes the stream's order over a longer stretch.
        pad_token_id: the token of the padding (its labels are -100 whatever it is).

    Raises:
        ValueError: ``seq`` below 2, ``rows`` or ``buffer_size`` below 1.

    Example::

        packer = Packer(seq=4096, rows=8, seed=0)
        for batch in packer.batches(examples):  # {"input_ids": [...], "labels": [...]} each
            loss = model(**batch.model_inputs(model, device)).loss
            loss.backward()
        share = packer.padding_share()  # PaddingShare(packed=..., unpacked=...)
    """

    def __init__(self, *, seq: int, rows: int, seed: int = 0, buffer_size: int = 1024, pad_token_id: int = 0) -> None:
        for name, value, least in (("seq", seq, 2), ("rows", rows, 1), ("buffer_size", buffer_size, 1)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"Packer: {name} must be an integer of at least {least}, got {value!r}")
        self.seq, self.rows, self.buffer_size, self.pad_token_id = seq, rows, buffer_size, pad_token_id
        self._random = random.Random(seed)
        # Tokens and padding, packed and unpacked, over everything packed so far.
        self._packed = [0, 0]
        self._unpacked = [0, 0]

    def batches(self, examples: Iterable[Mapping[str, Sequence[int]]]) -> Iterator[PackedBatch]:
        """Pack ``examples`` (each ``{"input_ids": [...], "labels": [...]}``, at most ``seq`` tokens) into batches.

        Raises:
            ValueError: an example lacks ``input_ids`` or ``labels``, they differ in length, or it is
                empty or longer than ``seq`` (the message gives its position in ``examples``).
        """
        buffer: List[_Example] = []
        group: List[int] = []  # lengths of the unpacked batch being counted
        for number, example in enumerate(examples):
            buffer.append(self._checked(number, example))
            length = len(buffer[-1][0])
            if group and (len(group) + 1) * max(*group, length) > self.rows * self.seq:
                self._count_unpacked(group)
                group = []
            group.append(length)
            if len(buffer) >= self.buffer_size:
                buffer = yield from self._pack(buffer, final=False)
        if group:
            self._count_unpacked(group)
        yield from self._pack(buffer, final=True)

    def padding_share(self) -> PaddingShare:
        """The share of padding in everything :meth:`batches` has packed so far, and without packing.

        Raises:
            ValueError: nothing was packed yet.
        """
        if not self._packed[0]:
            raise ValueError("padding_share: nothing was packed yet; iterate over batches(examples) first")
        return PaddingShare(packed=self._packed[1] / sum(self._packed),
                            unpacked=self._unpacked[1] / sum(self._unpacked))

    def _checked(self, number: int, example: Mapping[str, Sequence[int]]) -> _Example:
        if not isinstance(example, Mapping) or "input_ids" not in example or "labels" not in example:
            raise ValueError(f"example {number}: expected a mapping with 'input_ids' and 'labels' (lists of token "
                             f"ids, labels -100 where no loss), got {type(example).__name__}")
        ids, labels = [int(t) for t in example["input_ids"]], [int(t) for t in example["labels"]]
        if len(ids) != len(labels):
            raise ValueError(f"example {number}: {len(ids)} input_ids but {len(labels)} labels; give one label "
                             f"per token (-100 where no loss)")
        if not 1 <= len(ids) <= self.seq:
            raise ValueError(f"example {number}: {len(ids)} tokens, expected 1 to seq={self.seq}; truncate "
                             f"longer examples to seq tokens (or drop empty ones) before packing")
        return ids, labels

    def _count_unpacked(self, lengths: List[int]) -> None:
        tokens = sum(lengths)
        self._unpacked[0] += tokens
        self._unpacked[1] += max(lengths) * len(lengths) - tokens

    def _pack(self, buffer: List[_Example], *, final: bool) -> Generator[PackedBatch, None, List[_Example]]:
        """Yield the batches of ``buffer``; return the examples held back for the next buffer."""
        self._random.shuffle(buffer)
        rows = first_fit_decreasing([len(ids) for ids, _ in buffer], self.seq)
        # Rows come out fullest first: keep back the emptiest, which the next buffer can fill further.
        kept = len(rows) if final else len(rows) - len(rows) % self.rows
        emitted = rows[:kept]
        self._random.shuffle(emitted)
        for start in range(0, kept, self.rows):
            yield self._batch([[buffer[i] for i in row] for row in emitted[start : start + self.rows]])
        return [buffer[i] for row in rows[kept:] for i in row]

    def _batch(self, rows: List[List[_Example]]) -> PackedBatch:
        shape = (len(rows), self.seq)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.empty(shape, dtype=torch.long)
        tokens = 0
        for r, documents in enumerate(rows):
            at = 0
            for ids, document_labels in documents:
                end = at + len(ids)
                input_ids[r, at:end] = torch.tensor(ids)
                labels[r, at + 1 : end] = torch.tensor(document_labels[1:], dtype=torch.long)
                position_ids[r, at:end] = torch.arange(len(ids))
                at = end
            tokens += at
            position_ids[r, at:] = torch.arange(self.seq - at)  # the padding: a document of its own
        self._packed[0] += tokens
        self._packed[1] += input_ids.numel() - tokens
        return PackedBatch(input_ids=input_ids, labels=labels, position_ids=position_ids,
                           documents=sum(len(documents) for documents in rows), tokens=tokens)
