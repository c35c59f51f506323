"""Records to training examples: token ids and labels, -100 where no loss is taken, cut to a length.

An example is ``{"input_ids": list[int], "labels": list[int]}`` of equal length. ``labels`` is
``input_ids`` where the model should learn to write the token and ``IGNORE_INDEX`` elsewhere: by
default the completion (after a prompt) or the assistant's turns (of a conversation), each with the
end-of-text token that closes it; a ``text`` record is learnt whole. Hugging Face causal LMs shift the
labels themselves, so ``labels[i]`` is the target of the prediction made at position ``i - 1``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from .chat import render_chat, tokens_in_spans
from .read import DataError, progress_bars
from .shape import Fields, Shape

IGNORE_INDEX = -100
"""The label of a token no loss is taken on: torch's cross-entropy, and every Hugging Face loss, skips it."""

# datasets' progress bar appears from this many records on: a small set tokenizes in a blink.
PROGRESS_FROM = 10_000


class TrainOn(enum.Enum):
    """Which tokens the loss counts."""

    COMPLETION = "completion"  # the completion / the assistant's turns (a text record: all of it)
    ALL = "all"  # every token


@dataclass(frozen=True)
class TokenizeReport:
    """What tokenizing a set did: how many examples were longer than the cut, and how many were dropped."""

    examples: int  # records read
    kept: int  # examples handed on
    cut: int  # examples longer than the cut, truncated (the dropped ones included)
    dropped: int  # examples with nothing to learn left after the cut
    longest: int  # tokens of the longest example before the cut
    first_dropped: Optional[int]  # the index (from 0) of the first dropped record


def tokenize_record(record: Mapping[str, Any], tokenizer: Any, shape: Shape, *, max_length: int,
                    train_on: TrainOn = TrainOn.COMPLETION, fields: Fields = Fields()) -> Dict[str, Any]:
    """One record as an example cut to ``max_length`` tokens, plus ``length``, its tokens before the cut.

    Raises:
        DataError: a field that is not a string (missing, null), or a conversation the chat template refuses.
    """
    values = {}
    for name in shape.names:
        value = record.get(fields.column(name))
        if shape is not Shape.MESSAGES and not isinstance(value, str):
            column = fields.column(name)
            raise DataError(f"its {name!r}{'' if column == name else f' (column {column!r})'} is {value!r}, "
                            "not a string")
        values[name] = value
    if shape is Shape.MESSAGES:
        ids, learnt = render_chat(tokenizer, values["messages"])
    elif shape is Shape.PROMPT_COMPLETION:
        prompt = values["prompt"]
        ids, learnt = tokens_in_spans(tokenizer, prompt + values["completion"],
                                      [(len(prompt), len(prompt) + len(values["completion"]))],
                                      add_special_tokens=True)
    else:
        ids = list(tokenizer(values["text"])["input_ids"])
        learnt = [True] * len(ids)
    if shape is not Shape.MESSAGES and tokenizer.eos_token_id is not None and ids[-1:] != [tokenizer.eos_token_id]:
        ids.append(tokenizer.eos_token_id)  # the model learns where a completion or a document ends
        learnt.append(True)
    labels = [t if keep or train_on is TrainOn.ALL else IGNORE_INDEX for t, keep in zip(ids, learnt)]
    return {"input_ids": ids[:max_length], "labels": labels[:max_length], "length": len(ids)}


def tokenize_records(dataset: Any, tokenizer: Any, shape: Shape, *, max_length: int,
                     train_on: TrainOn = TrainOn.COMPLETION, fields: Fields = Fields(),
                     progress: Optional[bool] = None) -> Tuple[Any, TokenizeReport]:
    """Every record of a ``datasets.Dataset`` tokenized (``tokenize_record``), those with nothing to learn dropped.

    Args:
        progress: show datasets' progress bar (default: from ``PROGRESS_FROM`` records on).

    Returns:
        The examples (a ``datasets.Dataset`` of ``input_ids`` and ``labels``), and a ``TokenizeReport``.

    Raises:
        DataError: as ``tokenize_record``, naming the example (counted from 1).
    """
    def one(record: Mapping[str, Any], index: int) -> Dict[str, Any]:
        try:
            example = tokenize_record(record, tokenizer, shape, max_length=max_length, train_on=train_on,
                                      fields=fields)
        except DataError as error:
            raise DataError(f"example {index + 1}: {error}") from None
        # The first label is never a target (nothing comes before it): something after it must be.
        example["learns"] = any(label != IGNORE_INDEX for label in example["labels"][1:])
        return example

    with progress_bars(len(dataset) >= PROGRESS_FROM if progress is None else progress):
        tokenized = dataset.map(one, with_indices=True, remove_columns=dataset.column_names, desc="tokenizing")
    lengths, learns = tokenized["length"], tokenized["learns"]
    dropped = [i for i, ok in enumerate(learns) if not ok]
    report = TokenizeReport(examples=len(dataset), kept=len(dataset) - len(dropped),
                            cut=sum(n > max_length for n in lengths), dropped=len(dropped), longest=max(lengths),
                            first_dropped=dropped[0] if dropped else None)
    if dropped:
        tokenized = tokenized.select([i for i, ok in enumerate(learns) if ok])
    return tokenized.remove_columns(["length", "learns"]), report

