"""The command line of examples/finetune_hf.py: its arguments, the checks of every input before any process
starts, and resuming on another number of processes (finetune_hf_launch.py starts the processes).

Plumbing, kept apart so that finetune_hf.py reads as the fine-tune itself. A user mistake found here
or by the workers is one message and exit status 2; see finetune_hf.py's docstring for the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, NoReturn, Optional, Set, Tuple, Union

import torch

from bmtwrap.data import DataError, Fields, MissingFields, Shape, find_shape, is_records, read_records

EXAMPLE = Path(__file__).resolve().parent / "finetune_hf.py"
DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "genesis_exodus_kjv.txt"
PROG = "finetune_hf.py"
# The launching process names a folder here where its torchrun workers report how the run ended.
REPORT_ENV = "FINETUNE_HF_REPORT"
# Exit statuses (finetune_hf.py's docstring says when): 1 is also a run that failed or crashed.
LEARNED, DID_NOT_LEARN, MISTAKE, INTERRUPTED = 0, 1, 2, 130
FAILED = DID_NOT_LEARN

# Llama shapes built from a config when no --model is given (1b/3b/8b: Llama 3.2 1B/3B and Llama 3 8B).
SHAPES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}


class UsageError(Exception):
    """A mistake in the arguments or inputs: reported as one message, exit status 2, no traceback."""


class RunFailed(Exception):
    """A failure after the start whose cause is known and named (a full disk, a damaged checkpoint).

    Reported as one message, exit status 1, no traceback; ``resumable``: the checkpoint in --out (if
    any) is still good to continue from, and the message says so.
    """

    def __init__(self, message: str, *, resumable: bool = True) -> None:
        super().__init__(message)
        self.resumable = resumable


class Outcome(NamedTuple):
    """How this process ends: an exit status and the message printed once (empty: none)."""

    status: int
    message: str = ""
    stopped: bool = False  # the run stopped before its end: the message goes on to say which checkpoint is intact
    traceback: str = ""  # a crash's: written to --out/errors.log, not to the terminal
    consequence: bool = False  # this rank failed because another one did (a collective lost its peer)


# -----------------------------------------------------------------------------
# the command line


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank parses the same arguments
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(MISTAKE)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, except where there is none to show (None, a flag's False)
    or the help states it already."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: Optional[List[str]] = None, description: str = "") -> argparse.Namespace:
    p = Parser(prog=PROG, usage="%(prog)s [--model FOLDER] [--data FILE] [--out FOLDER] [options]",
               description=description, formatter_class=HelpFormatter)
    what = p.add_argument_group("model and data")
    what.add_argument("--model", type=Path, help="a local Hugging Face folder of a causal LM (config, safetensors, "
                      "tokenizer); default: a small Llama built from --shape")
    what.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="the Llama shape built without --model")
    what.add_argument("--data", type=Path, default=DEFAULT_DATA,
                      help="a UTF-8 text file (cut into --seq windows), or records: a .jsonl, .json, .parquet or .csv "
                      "file, a folder of them, or a folder saved by datasets' save_to_disk, each record holding "
                      "'messages' (a conversation), 'prompt' and 'completion', or 'text'")
    what.add_argument("--fields", type=fields_option, default=Fields(), metavar="FIELD=COLUMN,...",
                      help="the columns of the records that hold the fields, e.g. prompt=question,completion=answer "
                      "(none: each field is the column of its own name)")
    what.add_argument("--train-on", default="completion", choices=["completion", "all"],
                      help="the tokens the loss counts in records: the completion or the assistant's turns, or all")
    what.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE", default=None,
                      help="a Jinja chat template (a file, or the template itself) to render 'messages' with, in place "
                      "of the tokenizer's (the default tokenizer's: bmtwrap.data.SIMPLE_CHAT_TEMPLATE)")
    what.add_argument("--pack", default="auto", choices=["auto", "on", "off"],
                      help="records: pack several examples into each row of --seq tokens, each attending only to "
                      "itself (auto: where bmtwrap.data.check_packing accepts the model, else pad; off: one example "
                      "a row, padded as --pad-to says)")
    what.add_argument("--pad-to", default="longest", choices=["longest", "seq"],
                      help="unpacked records: pad each batch to its longest example, or to --seq")
    what.add_argument("--holdout", type=float, default=0.1,
                      help="share of the text (or of the records) kept for perplexity, in (0, 1)")
    what.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary trained without --model")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=300, help="optimizer steps of the whole run")
    train.add_argument("--batch", type=int, default=8, help="sequences per process per micro-batch")
    train.add_argument("--seq", type=int, default=128, help="tokens per sequence (at most the model's positions)")
    train.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    train.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    train.add_argument("--warmup", type=int, default=None,
                       help="warmup steps, then a cosine to 0 after --steps (default: 10%% of --steps)")
    train.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay (not on norms and biases)")
    train.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    train.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="parameter dtype (auto: bfloat16 on GPUs, float32 on the CPU); Adam keeps an fp32 master")
    train.add_argument("--seed", type=int, default=0)
    engine = p.add_argument_group("bmtwrap")
    engine.add_argument("--optimizer", default="auto", choices=["auto", "adam", "offload"],
                        help="auto: bmtwrap.optim.auto_adam (offload only what --max-gpu-memory or offloaded "
                             "parameters call for); adam: fused Adam on the device; offload: master and moments in "
                             "CPU memory")
    engine.add_argument("--offload-params", nargs="?", const="true", default="auto", choices=["true", "false", "auto"],
                        help="keep the layers' parameter shards in CPU memory (wrap(offload_params=...)); auto: "
                             "only where they would not leave room on the GPU")
    engine.add_argument("--recompute", default="true", choices=["true", "false", "auto"],
                        help="activation checkpointing of the decoder layers (wrap(checkpoint=...))")
    engine.add_argument("--max-gpu-memory", metavar="SIZE", default=None,
                        help="the most GPU memory each process should take, e.g. 24GiB (wrap(max_gpu_memory=...)): "
                             "--recompute auto and --optimizer offload plan for it instead of the whole card")
    engine.add_argument("--fp8", default="off", choices=["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"],
                        help="the decoder layers' linear layers compute in float8 (wrap(fp8=...), torchao); needs "
                             "GPUs with float8 tensor cores (H100, H200, L4) and pip install 'bmtwrap[fp8]'")
    engine.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) instead of every weight")
    engine.add_argument("--lora-rank", type=int, default=16)
    engine.add_argument("--lora-targets", default=None,
                        help="comma-separated names of the layers LoRA adapts, e.g. q_proj,v_proj (default: "
                        "peft's all-linear, every linear layer but the output one, whatever the model names them)")
    engine.add_argument("--processes", type=int, default=None,
                        help="processes when started without torchrun (default: one per GPU, else 2)")
    io = p.add_argument_group("checkpoints and output")
    io.add_argument("--out", type=Path, default=Path("finetune-out"), help="folder for everything written")
    io.add_argument("--save-every", type=int, default=100, help="sharded checkpoint every N steps (0: only at the end)")
    io.add_argument("--resume", action="store_true",
                    help="continue from the checkpoint in --out (also on another number of processes)")
    io.add_argument("--stop-at", type=int, default=None,
                    help="stop after this step (with a checkpoint); --resume continues the same run")
    io.add_argument("--eval-batches", type=int, default=16, help="held-out batches per process for perplexity")
    io.add_argument("--prompt", default="And God said", help="the prompt of the generated sample")
    io.add_argument("--sample-tokens", type=int, default=32)
    args = p.parse_args(argv)
    check_numbers(args, p)
    return args


def check_numbers(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Each number names itself when out of range; --steps first, as --warmup and --stop-at follow it."""
    at_least = [("--steps", args.steps, 1), ("--batch", args.batch, 1), ("--seq", args.seq, 2),
                ("--grad-accum", args.grad_accum, 1), ("--vocab", args.vocab, 257), ("--lora-rank", args.lora_rank, 1),
                ("--save-every", args.save_every, 0), ("--eval-batches", args.eval_batches, 1),
                ("--sample-tokens", args.sample_tokens, 1)]
    if args.processes is not None:
        at_least.append(("--processes", args.processes, 1))
    for flag, value, low in at_least:
        if value < low:
            why = {"--seq": " (a sequence predicts its tokens from the ones before)",
                   "--vocab": " (the 256 bytes and the end-of-text token)"}.get(flag, "")
            p.error(f"{flag} must be >= {low}{why}, got {value}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr must be a positive number, got {args.lr}")
    if not 0 < args.holdout < 1:
        p.error(f"--holdout must be in (0, 1), the share of the text kept for perplexity, got {args.holdout}")
    for flag, value in [("--weight-decay", args.weight_decay), ("--max-grad-norm", args.max_grad_norm)]:
        if not (math.isfinite(value) and value >= 0):
            p.error(f"{flag} must be a number >= 0, got {value}")
    if args.warmup is None:
        args.warmup = args.steps // 10
    if not 0 <= args.warmup <= args.steps:
        p.error(f"--warmup must be in [0, --steps={args.steps}], got {args.warmup}")
    if args.stop_at is not None and not 0 < args.stop_at <= args.steps:
        p.error(f"--stop-at must be in [1, --steps={args.steps}], got {args.stop_at}")
    if args.max_gpu_memory is not None:
        from bmtwrap.engine.memory import parse_bytes

        try:
            parse_bytes(args.max_gpu_memory, name="--max-gpu-memory")
        except ValueError as error:
            p.error(str(error))
    if args.fp8 != "off" and not torch.cuda.is_available():
        p.error(f"--fp8 {args.fp8} computes in float8, which needs GPUs with float8 tensor cores (H100, H200, L4); "
                "this machine has no CUDA GPU: leave --fp8 off")
    if args.lora_targets is not None and not (args.lora and lora_targets(args)):
        p.error(f"--lora-targets names the layers --lora adapts: give it with --lora and at least one name, "
                f"got {args.lora_targets!r}{'' if args.lora else ' without --lora'}")


def planned_world_size(args: argparse.Namespace) -> int:
    if "WORLD_SIZE" in os.environ:  # under torchrun, the user's or ours
        return int(os.environ["WORLD_SIZE"])
    return args.processes or torch.cuda.device_count() or 2


# -----------------------------------------------------------------------------
# checks before any process starts: every input a user can get wrong, found in seconds, not after training


def check_inputs(args: argparse.Namespace) -> None:
    """Raise UsageError for the first mistake in --data, --model, --lora-targets or --out."""
    shape = check_data(args)
    config = check_model(args)
    if shape is not None and args.pack == "on":
        check_packing_on(args, config)
    if shape is Shape.MESSAGES:
        check_chat_template(args)
    if args.lora and lora_targets(args) != "all-linear":
        check_lora_targets(args, config)
    check_out(args)


def fields_option(value: str) -> Fields:
    try:
        return Fields.parse(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_data(args: argparse.Namespace) -> Optional[Shape]:
    """The shape of --data's records (None: a text file), after checking that they can be read."""
    path = args.data
    if path.exists() and is_records(path):
        records = read_records_or_refuse(args)
        try:
            return find_shape(records.column_names, args.fields)
        except MissingFields as error:
            example = f"prompt={error.found[0]},completion={error.found[-1]}" if len(error.found) > 1 else \
                f"text={error.found[0]}" if error.found else "prompt=question,completion=answer"
            raise UsageError(f"--data {path}: {error}; name the columns that hold them with --fields, e.g. "
                             f"--fields {example}") from None
    if args.fields.columns:
        raise UsageError(f"--fields {args.fields} names columns of records, but --data {path} is a text file")
    check_text(path)
    return None


def read_records_or_refuse(args: argparse.Namespace) -> Any:
    """--data's records (a datasets.Dataset), read by bmtwrap.data; a DataError becomes a UsageError."""
    try:
        return read_records(args.data)
    except DataError as error:
        raise UsageError(f"--data {error}") from None


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template itself."""
    if Path(value).is_file():
        return Path(value).read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise UsageError(f"--chat-template {value}: no such file, nor a Jinja template (no {{{{ or {{%); give a file "
                     "or the template itself")


def check_chat_template(args: argparse.Namespace) -> None:
    """Conversations need a chat template: --chat-template, the --model tokenizer's, or the default's own."""
    if args.chat_template is not None:
        read_chat_template(args.chat_template)
        return
    if args.model is None:
        return  # the default tokenizer carries bmtwrap.data.SIMPLE_CHAT_TEMPLATE
    import transformers

    if not getattr(transformers.AutoTokenizer.from_pretrained(args.model), "chat_template", None):
        raise UsageError(f"--data {args.data} holds conversations ('messages'), but the tokenizer of --model "
                         f"{args.model} has no chat template to render them with; give one with --chat-template "
                         "(a Jinja file or string, e.g. the template of the model's instruct version)")


def check_text(path: Path) -> None:
    if not path.is_file():
        raise UsageError(f"--data {path}: no such file")
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"--data {path} is not UTF-8 text: byte 0x{raw[error.start]:02x} at offset {error.start} "
                         f"({error.reason}); convert it first, e.g. `iconv -f LATIN1 -t UTF-8 {path} > "
                         f"{path.stem}.utf8{path.suffix}` (with the encoding it is in), and give that file") from None


def check_model(args: argparse.Namespace) -> Any:
    """The --model folder's config, after checking that it is a causal LM that fits --seq; None without --model."""
    if args.model is None:
        return None
    if not (args.model / "config.json").is_file():
        raise UsageError(f"--model {args.model}: no config.json there; give a local Hugging Face model folder")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as error:
        raise UsageError(f"--model {args.model}: transformers {transformers.__version__} cannot read its "
                         f"config.json ({error})") from None
    check_causal_lm(args.model, config)
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and args.seq > positions:
        raise UsageError(f"--seq {args.seq} is longer than the {positions} positions of --model {args.model} "
                         f"(max_position_embeddings in its config.json); give --seq {positions} or less")
    if not any((args.model / name).is_file() for name in TOKENIZER_FILES) and not any(args.model.glob("*.tiktoken")):
        # Else transformers' first complaint is a missing sentencepiece or tiktoken package.
        raise UsageError(f"--model {args.model}: no tokenizer files there (none of {', '.join(TOKENIZER_FILES)}, "
                         "*.tiktoken); copy them in from where the model came from (tokenizer.save_pretrained "
                         "writes them)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(f"--model {args.model}: no tokenizer could be loaded from it ({error}); "
                         "the folder needs its tokenizer files") from None
    prompt = len(tokenizer(args.prompt)["input_ids"])
    if positions is not None and prompt + args.sample_tokens > positions:
        raise UsageError(f"--sample-tokens {args.sample_tokens} after the prompt's {prompt} tokens pass the "
                         f"{positions} positions of --model {args.model}; give --sample-tokens "
                         f"{positions - prompt} or less")
    return config


# A tokenizer's vocabulary, one of which every tokenizer folder holds: a fast tokenizer's, a sentencepiece
# model (Llama 2, Mistral, Gemma; T5's spiece.model), a BPE's or WordPiece's vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt")


def check_causal_lm(folder: Path, config: Any) -> None:
    """Refuse a model that AutoModelForCausalLM would not build as the folder saved it."""
    from transformers.models.auto import modeling_auto as auto

    def names(mapping: Dict[str, Union[str, Tuple[str, ...]]]) -> Set[str]:
        return {n for v in mapping.values() for n in ((v,) if isinstance(v, str) else v)}

    saved = (config.architectures or [None])[0]
    if saved in names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return
    base_model = saved in (None, auto.MODEL_MAPPING_NAMES.get(config.model_type))
    if base_model and config.model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not config.is_encoder_decoder:
        # A family's base model (LlamaModel): its causal LM loads the same weights and adds a new head.
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{PROG}: --model {folder} holds a {saved or config.model_type} model without a language-model "
                  f"head: fine-tuning {auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]}, its head newly "
                  "initialised (or tied to the embeddings)", flush=True)
        return
    seq2seq = config.is_encoder_decoder or saved in names(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    raise UsageError(f"--model {folder} holds a {saved or config.model_type} "
                     f"({'sequence-to-sequence' if seq2seq else 'not a causal language model'}): {PROG} fine-tunes "
                     "causal language models (the classes transformers.AutoModelForCausalLM builds, e.g. "
                     "LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel); for this model use "
                     "bmtwrap.from_pretrained(folder, model_class=...) in your own loop, or bmtwrap.hf.Trainer")


# The layer types peft's LoRA adapts (Conv1D: GPT-2's linear layers).
LORA_LAYERS = ("Linear", "Conv1D", "Conv1d", "Conv2d", "Conv3d", "Embedding")


def lora_targets(args: argparse.Namespace) -> Union[str, List[str]]:
    """peft's target_modules: the names given, or every linear layer but the output one."""
    if args.lora_targets in (None, "all-linear"):
        return "all-linear"
    return [name.strip() for name in args.lora_targets.split(",") if name.strip()]


def meta_model(args: argparse.Namespace, config: Any) -> torch.nn.Module:
    """The model of --model's config (None: the default's), on the meta device: its names and config, no memory."""
    import transformers

    with torch.device("meta"):
        if config is not None:
            return transformers.AutoModelForCausalLM.from_config(config)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES[args.shape]))


def check_lora_targets(args: argparse.Namespace, config: Any) -> None:
    """Every name in --lora-targets ends the name of a layer LoRA adapts, as peft matches them."""
    model = meta_model(args, config)
    layers = [name for name, module in model.named_modules() if type(module).__name__ in LORA_LAYERS]
    missing = [t for t in lora_targets(args) if not any(n == t or n.endswith("." + t) for n in layers)]
    if missing:
        have = sorted({name.rsplit(".", 1)[-1] for name in layers})
        raise UsageError(f"--lora-targets {args.lora_targets}: the model has no layer named {', '.join(missing)} "
                         f"that LoRA can adapt; its layers are named {', '.join(have)}")


def folders_written(args: argparse.Namespace) -> List[Path]:
    folders = [args.out, args.out / "checkpoint", args.out / "hf"]
    if args.model is None:
        folders.append(args.out / ("base" if args.lora else "tokenizer"))
    return folders


def check_out(args: argparse.Namespace) -> None:
    """Create every folder the run writes and a file in each: a save must not fail after hours of training."""
    for folder in folders_written(args):
        probe = folder / f".finetune_hf-probe-{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            blocking = next((p for p in [folder, *folder.parents] if p.exists() and not p.is_dir()), None)
            if blocking is not None:
                raise UsageError(f"--out {args.out}: cannot create the folder {folder}: {blocking} is a file; "
                                 "move it away or give another --out") from None
            raise UsageError(f"--out {args.out}: cannot create or write the folder {folder} "
                             f"({error.strerror or error}); give an --out in a folder you can write") from None


def check_packing_on(args: argparse.Namespace, config: Any) -> None:
    """--pack on: the model is of a family known to keep packed examples apart (the workers check the loaded one)."""
    from bmtwrap.data import check_packing

    try:
        check_packing(meta_model(args, config))
    except NotImplementedError as refusal:
        raise pack_refused(refusal) from None


def pack_refused(refusal: NotImplementedError) -> UsageError:
    return UsageError(f"--pack on: {refusal}; give --pack off (or --pack auto, which packs only where the model "
                      "allows)")


# -----------------------------------------------------------------------------
# resuming: the same run, on this or another number of processes


def saved_run(folder: Path) -> Dict[str, Any]:
    """What the checkpoint's run recorded (the ``extra`` save_checkpoint wrote into its index.json)."""
    index = folder / "index.json"
    if not index.is_file():
        raise UsageError(f"--resume: no checkpoint in {folder}; train without --resume first")
    extra = json.loads(index.read_text()).get("extra")
    if not isinstance(extra, dict) or "global_batch" not in extra:
        raise UsageError(f"--resume: the checkpoint in {folder} was not written by this version of {PROG}; "
                         "train without --resume")
    return extra


def run_identity(args: argparse.Namespace) -> Dict[str, str]:
    """The settings a resumed run must share with the saved one for its losses to continue it."""
    keys = ["shape", "holdout", "vocab", "steps", "seq", "grad_accum", "lr", "warmup", "weight_decay",
            "max_grad_norm", "dtype", "seed", "optimizer", "lora", "lora_rank", "lora_targets", "fields", "train_on",
            "chat_template", "pad_to", "pack"]
    identity = {k: str(getattr(args, k)) for k in keys}
    return identity | {"model": str(args.model and args.model.resolve()), "data": str(args.data.resolve())}


def resumed_batch(args: argparse.Namespace, world: int) -> int:
    """The per-process batch that keeps the checkpoint's global batch (batch x processes) on ``world`` processes.

    The global batch fixes what every step reads from the data stream, so the resumed run continues
    the same stream whatever the number of processes.
    """
    folder = args.out / "checkpoint"
    saved = saved_run(folder)
    changed = {k: f"{saved['run'].get(k)} -> {v}" for k, v in run_identity(args).items() if saved["run"].get(k) != v}
    if changed:
        raise UsageError(f"--resume: the checkpoint in {folder} was saved by a run with other settings {changed}; "
                         "resume with the same ones")
    global_batch, saved_world = saved["global_batch"], saved["processes"]
    if args.batch * world == global_batch:
        return args.batch
    if args.batch * saved_world != global_batch:
        raise UsageError(f"--resume with --batch {args.batch}: the checkpoint's run took {global_batch} sequences "
                         f"per step (--batch {global_batch // saved_world} on {saved_world} processes); resume with "
                         f"--batch {global_batch // saved_world}: it is divided anew over the processes")
    if global_batch % world:
        fits = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        raise UsageError(f"--resume on {world} processes: the checkpoint's run took {global_batch} sequences per step, "
                         f"which {world} processes cannot share evenly; resume on {', '.join(map(str, fits))} "
                         "processes (--processes, or torchrun's --nproc_per_node)")
    return global_batch // world
