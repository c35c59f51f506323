"""The data of examples/finetune_hf.py: its tokenizer, and the batches it trains and measures on.

Two kinds of --data. A text file is one token stream cut into --seq windows, every token learnt (as
the embedded default has always trained). Records (JSON Lines, JSON, Parquet, CSV, a folder of them,
or a folder saved by ``datasets``) are read, rendered and tokenized by ``bmtwrap.data``: each record
is one example, its loss on the completion or the assistant's turns (--train-on), cut to --seq; batches
pack several examples into each row of --seq tokens (``bmtwrap.data.Packer``, --pack) or hold one example
a row, padded to the batch's longest (--pad-to). Every rank computes the same data, so a mistake found
here is raised on all of them as one UsageError.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

import bmtwrap as bmt
from finetune_hf_cli import UsageError, pack_refused, read_chat_template, read_records_or_refuse

EOS = "<|endoftext|>"
T = TypeVar("T")


class Batch(NamedTuple):
    """One process's share of a batch, and what the whole batch (all processes) holds."""

    input_ids: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), -100 where no loss is taken
    attention_mask: Optional[torch.Tensor]  # (B, T), 0 on padding; None: no padding
    tokens: int = 0  # the whole batch's tokens, padding excluded
    padding: int = 0  # the whole batch's padding tokens
    targets: int = 0  # the whole batch's predicted tokens (see predicted())
    position_ids: Optional[torch.Tensor] = None  # (B, T), packed rows: restarting at every example

    def inputs(self, model: torch.nn.Module, device: torch.device) -> Dict[str, Any]:
        """``model``'s keyword arguments, on ``device``: packed rows as ``bmtwrap.data.packed_inputs`` gives them."""
        if self.position_ids is not None:
            from bmtwrap.data import packed_inputs

            return packed_inputs(model, device, input_ids=self.input_ids, labels=self.labels,
                                 position_ids=self.position_ids)
        names = ["input_ids", "labels"] + (["attention_mask"] if self.attention_mask is not None else [])
        return {name: getattr(self, name).to(device) for name in names}

    def predicted(self) -> int:
        """The tokens the loss averages over: labelled ones that have a token before them."""
        return int((self.labels[:, 1:] != -100).sum())


# -----------------------------------------------------------------------------
# the tokenizer


def load_tokenizer(args: argparse.Namespace, corpus: Callable[[], Iterator[str]], folder: Path) -> Any:
    """The model folder's tokenizer, or (default) a byte-level BPE trained on ``corpus()`` by rank 0.

    The default's tokenizer carries ``bmtwrap.data.SIMPLE_CHAT_TEMPLATE`` (or --chat-template), so
    conversations train without a --model; with --model, --chat-template replaces the folder's template.
    """
    import transformers

    template = read_chat_template(args.chat_template) if args.chat_template else None
    if args.model is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)  # check_model loaded it once already
        if template:
            tokenizer.chat_template = template
        return tokenizer
    # Trained afresh for a new run (the data may have changed), reused when resuming.
    if bmt.rank() == 0 and not (args.resume and (folder / "tokenizer.json").is_file()):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        from bmtwrap.data import SIMPLE_CHAT_TEMPLATE

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=[EOS], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        bpe.train_from_iterator(corpus(), trainer)
        trained = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS)
        trained.chat_template = template or SIMPLE_CHAT_TEMPLATE
        trained.save_pretrained(folder)
    bmt.synchronize()  # the other ranks read what rank 0 wrote
    return transformers.AutoTokenizer.from_pretrained(folder)


# -----------------------------------------------------------------------------
# a text file: windows of the token stream


@dataclass
class Windows:
    """The token stream cut into sequences: training ones in a seeded order, held-out ones fixed."""

    train: torch.Tensor  # (N, seq)
    held_out: torch.Tensor  # (M, seq)
    seed: int
    _order: Tuple[int, Optional[torch.Tensor]] = (-1, None)  # (epoch, its permutation): drawn once per epoch

    def batch(self, index: int, size: int, rank: int, world: int) -> Batch:
        """This rank's share of sequences ``[index * size, (index + 1) * size)`` of the endless shuffled stream."""
        share = size // world
        rows = [self.train[_epoch_order(self, len(self.train), i)] for i in range(index * size, (index + 1) * size)]
        ids = torch.stack(rows[rank * share : (rank + 1) * share])  # (share, seq)
        seq = self.train.shape[1]
        return Batch(ids, ids, None, tokens=size * seq, targets=size * (seq - 1))

    @property
    def held_out_count(self) -> int:
        return len(self.held_out)

    def held_out_batch(self, start: int, stop: int) -> Batch:
        ids = self.held_out[start:stop]  # (B, T)
        return Batch(ids, ids, None)

    def describe(self) -> str:
        return f"{self.train.numel():,} training tokens, {self.held_out.numel():,} held out"

    def unpacked_padding_share(self) -> Optional[float]:
        return None  # windows are full: nothing is packed

    chat = False  # the sample continues --prompt


def _epoch_order(data: Any, count: int, i: int) -> int:
    """Element ``i`` of the endless stream of epochs, each a seeded permutation of ``range(count)``."""
    epoch, position = divmod(i, count)
    if data._order[0] != epoch:
        generator = torch.Generator().manual_seed(data.seed + epoch)
        data._order = (epoch, torch.randperm(count, generator=generator))
    return int(data._order[1][position])


def text_windows(args: argparse.Namespace, tokenizer: Any, text: str, world: int) -> Windows:
    """The text cut into --seq windows."""
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    cut = int(len(ids) * (1 - args.holdout))
    train, held_out = ids[:cut], ids[cut:]
    # Every rank scores at least one held-out sequence: each forward is a collective.
    if len(train) < args.seq or len(held_out) < args.seq * world:
        raise UsageError(f"--data {args.data}: its {len(ids)} tokens are too few for --seq {args.seq} with --holdout "
                         f"{args.holdout} on {world} processes (a training sequence and a held-out one per "
                         "process); give more text or a shorter --seq")
    windows = lambda t: t[: len(t) // args.seq * args.seq].view(-1, args.seq)  # noqa: E731
    return Windows(windows(train), windows(held_out), args.seed)


# -----------------------------------------------------------------------------
# records: one example each, in packed rows or padded batches


@dataclass
class Examples:
    """Tokenized examples (``{"input_ids", "labels"}``): training ones in a seeded order, held-out ones fixed.

    Training batches are packed rows once ``packing`` is set (pack_or_pad), else one example a row,
    padded; held-out batches are always padded, so perplexity means the same either way.
    """

    train: Any  # datasets.Dataset
    held_out: Any
    seed: int
    pad_id: int
    pad_to: Optional[int]  # None: each batch's longest example
    chat: bool  # conversations: the sample is the reply to --prompt as a user's message
    lengths: List[int] = field(default_factory=list)  # of the training examples
    packing: Optional[Packing] = None
    _order: Tuple[int, Optional[torch.Tensor]] = (-1, None)

    def __post_init__(self) -> None:
        self.lengths = [len(ids) for ids in self.train["input_ids"]]

    def batch(self, index: int, size: int, rank: int, world: int) -> Batch:
        """This rank's share of batch ``index`` (``size`` rows); tokens, padding and targets of all shares.

        Padded: examples ``[index * size, (index + 1) * size)`` of the stream. Packed: the stream's
        ``index``-th batch of ``size`` packed rows.
        """
        if self.packing is not None:
            return self.packing.batch(self, index, size, rank, world)
        from bmtwrap.data import pad_examples

        share = size // world
        rows = [_epoch_order(self, len(self.train), i) for i in range(index * size, (index + 1) * size)]
        lengths = [self.lengths[r] for r in rows]
        padding = sum((self.pad_to or max(part)) * len(part) - sum(part)
                      for part in (lengths[p * share : (p + 1) * share] for p in range(world)))
        chosen = self.train.select(rows)  # every process's share: each weighs its loss by its share of targets
        targets = sum(sum(label != -100 for label in labels[1:]) for labels in chosen["labels"])
        padded = pad_examples(chosen.select(range(rank * share, (rank + 1) * share)), self.pad_id, length=self.pad_to)
        return Batch(padded.input_ids, padded.labels, padded.attention_mask, tokens=sum(lengths), padding=padding,
                     targets=targets)

    @property
    def held_out_count(self) -> int:
        return len(self.held_out)

    def held_out_batch(self, start: int, stop: int) -> Batch:
        from bmtwrap.data import pad_examples

        padded = pad_examples(self.held_out.select(range(start, stop)), self.pad_id, length=self.pad_to)
        return Batch(padded.input_ids, padded.labels, padded.attention_mask)

    def stream(self) -> Iterator[Dict[str, Any]]:
        """The training examples, endlessly: the seeded epochs the padded batches read, one after another."""
        for i in itertools.count():
            yield self.train[_epoch_order(self, len(self.train), i)]

    def unpacked_padding_share(self) -> Optional[float]:
        """Packed: the padding one example a row would have taken (Packer.padding_share().unpacked); else None."""
        return None if self.packing is None else self.packing.unpacked_padding_share()

    def describe(self) -> str:
        how = f", packed into rows of {self.packing.seq} tokens" if self.packing else ", one a row, padded"
        return (f"{len(self.train):,} training examples ({sum(self.lengths):,} tokens){how}, "
                f"{len(self.held_out):,} held out")


@dataclass
class Packing:
    """The training examples' endless stream packed by ``bmtwrap.data.Packer`` into batches of full --seq rows.

    Batch ``i`` is the same whatever the number of processes (each takes its own rows of it) and
    however the run got there: the packer reads the stream from its start, so a run resumed at step
    ``s`` packs (and skips) the batches before it again, and goes on with the very batches an
    uninterrupted run trains on.
    """

    model: nn.Module  # PackedBatch.model_inputs checks it, and joins the rows for flash attention
    seq: int
    seed: int
    pad_id: int
    _packer: Any = None  # bmtwrap.data.Packer, made for the first batch's size
    _batches: Optional[Iterator[Any]] = None  # its batches (PackedBatch)
    _next: int = 0  # the index of the batch _batches yields next

    def batch(self, examples: Examples, index: int, size: int, rank: int, world: int) -> Batch:
        """This rank's rows of the ``index``-th packed batch of ``size`` rows."""
        if self._packer is None or index < self._next or size != self._packer.rows:
            self._start(examples, size)
        for _ in range(index - self._next):
            next(self._batches)
        packed = next(self._batches)
        self._next = index + 1
        rows = slice(rank * (size // world), (rank + 1) * (size // world))
        # documents and tokens stay the whole batch's: only the tensors are read below.
        mine = dataclasses.replace(packed, input_ids=packed.input_ids[rows], labels=packed.labels[rows],
                                   position_ids=packed.position_ids[rows]).model_inputs(self.model)
        return Batch(mine["input_ids"], mine["labels"], None, tokens=packed.tokens,
                     padding=packed.input_ids.numel() - packed.tokens,
                     targets=int((packed.labels[:, 1:] != -100).sum()), position_ids=mine["position_ids"])

    def _start(self, examples: Examples, size: int) -> None:
        from bmtwrap.data import Packer

        # A buffer of an epoch (at most 1024 examples), and at least enough for 4 batches: every buffer
        # then gives full batches (the emptiest rows wait for the next buffer).
        mean = sum(examples.lengths) / len(examples.lengths)
        buffer = max(min(1024, len(examples.lengths)), math.ceil(4 * size * self.seq / mean))
        self._packer = Packer(seq=self.seq, rows=size, seed=self.seed, buffer_size=buffer, pad_token_id=self.pad_id)
        self._batches, self._next = self._packer.batches(examples.stream()), 0

    def unpacked_padding_share(self) -> Optional[float]:
        return self._packer.padding_share().unpacked if self._packer is not None else None


def pack_or_pad(args: argparse.Namespace, data: Any, model: nn.Module) -> None:
    """--pack: records' training examples packed where check_packing accepts the model (auto, on), else padded.

    Raises:
        UsageError: --pack on, and the model is not known to keep packed examples apart.
    """
    from bmtwrap.data import check_packing

    if not isinstance(data, Examples) or args.pack == "off":
        return
    try:
        check_packing(model)
    except NotImplementedError as refusal:
        if args.pack == "on":
            raise pack_refused(refusal) from None
        bmt.print_rank(f"finetune_hf: --pack auto: one example a row, padded, not packed: {refusal}")
        return
    data.packing = Packing(model, args.seq, args.seed, data.pad_id)


def record_examples(args: argparse.Namespace, tokenizer: Any, records: Any, world: int) -> Examples:
    """The records tokenized (rank 0 first: the others read datasets' cache), split into training and held out."""
    from bmtwrap.data import DataError, Shape, TrainOn, find_shape, tokenize_records

    shape = find_shape(records.column_names, args.fields)  # check_data found it already
    try:
        examples, report = rank0_first(lambda: tokenize_records(records, tokenizer, shape, max_length=args.seq,
                                                                train_on=TrainOn(args.train_on), fields=args.fields))
    except DataError as error:
        raise UsageError(f"--data {args.data}: {error}") from None
    what = f"{report.cut} of its {report.examples} examples are longer than --seq {args.seq}"
    if report.kept == 0 or report.cut == report.examples:
        dropped = f"; {report.dropped} would be dropped, nothing to learn left after the cut" if report.dropped else ""
        raise UsageError(f"--data {args.data}: every example is cut: {what} (the longest has {report.longest} "
                         f"tokens){dropped}; give a longer --seq")
    if report.cut:
        dropped = (f"; {report.dropped} dropped, their {'assistant turns' if shape is Shape.MESSAGES else 'completion'}"
                   f" empty after the cut (the first: example {report.first_dropped + 1})") if report.dropped else ""
        bmt.print_rank(f"finetune_hf: --data {args.data}: {what} and cut (the longest has {report.longest} "
                       f"tokens){dropped}")
    held = max(1, round(len(examples) * args.holdout))
    if held < world or len(examples) - held < 1:
        raise UsageError(f"--data {args.data}: its {len(examples)} examples are too few for --holdout {args.holdout} "
                         f"on {world} processes (a training example, and a held-out one per process); give more "
                         "examples or a larger --holdout")
    # A seeded split: data files are often sorted, and the held-out examples should look like the rest.
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(args.seed)).tolist()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Examples(examples.select(order[held:]), examples.select(sorted(order[:held])), args.seed, pad_id,
                    args.seq if args.pad_to == "seq" else None, chat=shape is Shape.MESSAGES)


def rank0_first(make: Callable[[], T]) -> T:
    """``make()`` on rank 0, then on the others (which then read what it cached); its UsageError raised on all."""
    from bmtwrap.data import DataError

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    result, failure = None, None
    if dist.get_rank() == 0:
        try:
            result = make()
        except (UsageError, DataError) as error:
            failure = error
    shared = [failure]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        raise shared[0]
    return result if dist.get_rank() == 0 else make()


# -----------------------------------------------------------------------------
# either


def load_data(args: argparse.Namespace, world: int) -> Tuple[Any, Any]:
    """The tokenizer and the data (Windows or Examples) of --data."""
    from bmtwrap.data import is_records

    if not is_records(args.data):
        text = args.data.read_text(encoding="utf-8")
        tokenizer = load_tokenizer(args, lambda: iter(text.splitlines(keepends=True)), args.out / "tokenizer")
        return tokenizer, text_windows(args, tokenizer, text, world)
    records = read_records_or_refuse(args)
    tokenizer = load_tokenizer(args, lambda: record_strings(records), args.out / "tokenizer")
    return tokenizer, record_examples(args, tokenizer, records, world)


def record_strings(records: Any) -> Iterator[str]:
    """Every string in the records (message contents included): what the default tokenizer is trained on."""
    for batch in records.iter(batch_size=1000):
        for column in batch.values():
            for value in column:
                if isinstance(value, str):
                    yield value
                elif isinstance(value, list):
                    yield from (m["content"] for m in value
                                if isinstance(m, dict) and isinstance(m.get("content"), str))


def prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> torch.Tensor:
    """(1, T): the prompt's tokens, or (chat) a conversation of it as the user's message, awaiting the reply."""
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             return_dict=True, return_tensors="pt")["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]
