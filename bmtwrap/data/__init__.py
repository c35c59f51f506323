"""Training data for causal LMs: records read from local files, rendered, tokenized with labels, padded.

    records = read_records(Path("chat.jsonl"))                  # JSONL, JSON, Parquet, CSV, folders, save_to_disk
    shape = find_shape(records.column_names, Fields.parse("prompt=question,completion=answer"))
    examples, report = tokenize_records(records, tokenizer, shape, max_length=2048)
    batch = pad_examples(examples.select(range(8)), pad_id=tokenizer.pad_token_id)
    loss = model(input_ids=batch.input_ids, labels=batch.labels, attention_mask=batch.attention_mask).loss
    for packed in Packer(seq=2048, rows=8, seed=0).batches(examples):  # or: short examples packed into full rows
        loss = model(**packed.model_inputs(model, device)).loss

Shapes: ``messages`` (a conversation, rendered with the tokenizer's chat template), ``prompt`` +
``completion``, ``text``. By default the loss counts the completion or the assistant's turns only
(labels are -100 elsewhere). Packing (``packing.py``) puts many short examples in one row, each attending only
to itself.
``datasets`` is imported when data is read, never by ``import bmtwrap`` (``pip install bmtwrap[data]``).
"""

from .chat import SIMPLE_CHAT_TEMPLATE, render_chat
from .packing import (PACKING_FAMILIES, PackedBatch, Packer, PaddingShare, check_packing, first_fit_decreasing,
                      packed_inputs)
from .pad import PaddedBatch, pad_examples
from .read import DataError, is_records, read_records
from .shape import Fields, MissingFields, Shape, find_shape
from .tokenize import IGNORE_INDEX, TokenizeReport, TrainOn, tokenize_record, tokenize_records

__all__ = [
    "DataError",
    "Fields",
    "IGNORE_INDEX",
    "MissingFields",
    "PACKING_FAMILIES",
    "PackedBatch",
    "Packer",
    "PaddedBatch",
    "PaddingShare",
    "SIMPLE_CHAT_TEMPLATE",
    "Shape",
    "TokenizeReport",
    "TrainOn",
    "check_packing",
    "find_shape",
    "first_fit_decreasing",
    "is_records",
    "packed_inputs",
    "pad_examples",
    "read_records",
    "render_chat",
    "tokenize_record",
    "tokenize_records",
]
