"""Fine-tuning throughput through a Trainer: bmtwrap's drop-in against the same Trainer on accelerate's FSDP2.

    torchrun --nproc_per_node=2 benchmarks/trainer_llama.py --trainer sft --engine bmtwrap --size 8b --batch 2 --seq 4096
    torchrun --nproc_per_node=2 benchmarks/trainer_llama.py --trainer sft --engine fsdp2 --size 8b --batch 2 --seq 4096
    torchrun --nproc_per_node=1 benchmarks/trainer_llama.py --trainer hf --engine bmtwrap --size 8b --batch 4 --seq 2048
    # smoke test without GPUs (gloo, use_cpu=True):
    torchrun --nproc_per_node=2 benchmarks/trainer_llama.py --trainer sft --engine fsdp2 --size tiny --batch 2 --seq 64 \
        --steps 3 --warmup 1

``--trainer``: ``transformers.Trainer`` (``hf``) or TRL's ``SFTTrainer`` (``sft``). ``--engine``:
``bmtwrap`` is ``bmtwrap.hf.Trainer`` / ``bmtwrap.hf.SFTTrainer`` with every bmtwrap option at its
default; ``fsdp2`` is the plain class with accelerate's FSDP2 set as TRL's
``accelerate_configs/fsdp2.yaml`` sets it (version 2, ``TRANSFORMER_BASED_WRAP`` on
``LlamaDecoderLayer``, ``reshard_after_forward``, bf16 mixed precision: fp32 parameter shards updated
by AdamW, gathers and gradient reductions in bf16), through ``TrainingArguments(fsdp=...,
fsdp_config=...)``, so plain ``torchrun`` launches it. The
yaml's ``cpu_ram_efficient_loading`` is left off: it makes only rank 0 load a checkpoint, and here
every rank builds the same weights from the seed. accelerate applies FSDP on GPUs only: on CPUs
``--engine fsdp2`` trains with DDP over gloo (``fsdp2_units`` is 0 in the RESULT), a smoke test only.

Activation checkpointing: the arguments' ``gradient_checkpointing`` (TRL's SFTConfig turns it on by
default, transformers' TrainingArguments leaves it off). With bmtwrap it keeps its default meaning
(on: ``wrap(checkpoint=True)``; off: ``wrap``'s ``checkpoint="auto"``); ``--bmtwrap-checkpoint auto``
passes ``wrap_options={"checkpoint": "auto"}`` instead, whatever the arguments say. The FSDP2 peer takes
``--fsdp-checkpointing`` (default true: transformers' checkpointing in every decoder layer, what a TRL
user gets with that yaml).

The model: a randomly initialised Llama of ``--size`` (``benchmarks/train_llama.py``'s shapes, and
``tiny`` for CPUs), built in bf16 (on the process's GPU, if any) as TRL loads a bf16 checkpoint (``dtype="auto"``).
The data: random token ids, every row ``--seq`` long (no padding), ``labels`` = ``input_ids``. AdamW
at lr 1e-5, ``max_grad_norm`` 1.0, no logging, evaluation or saving. The median of the step times
(a ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end``) after ``--warmup`` steps. Prints one
line, ``RESULT {json}``, on rank 0; on a CUDA out-of-memory error ``RESULT {..., "oom": true}`` and
exit status 0, so that a batch of runs goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List

import datasets
import torch
import transformers
from accelerate.optimizer import AcceleratedOptimizer

from fsdp2_peer import SIZES
from train_llama import PEAK_FLOPS, add_shape_arguments, compiled_blocks, flops_per_token, shape


class StepTimer(transformers.TrainerCallback):
    """Each optimizer step's wall time, and the peak memory from the start of training."""

    def __init__(self) -> None:
        self.times: List[float] = []
        self.start = 0.0

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if torch.cuda.is_available():  # the model is sharded by now: its build and load are not counted
            torch.cuda.reset_peak_memory_stats()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        self.start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self.start)


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A two-word tokenizer made here (no files, no network): the Trainers want one for its pad token."""
    from tokenizers import Tokenizer, models

    words = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


def fsdp2_options(checkpointing: bool) -> Dict[str, Any]:
    """TrainingArguments for accelerate's FSDP2 as TRL's accelerate_configs/fsdp2.yaml sets it."""
    return dict(fsdp=True, gradient_checkpointing=checkpointing, fsdp_config={
        "version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True,
        "activation_checkpointing": False, "cpu_offload": False, "state_dict_type": "FULL_STATE_DICT",
        "cpu_ram_efficient_loading": False})


def bmtwrap_choices(trainer: transformers.Trainer) -> Dict[str, Any]:
    """What bmtwrap's "auto" options chose: blocks kept (not recomputed), compiled blocks, offload."""
    from bmtwrap.wrap.convert import wrapped_record

    record = wrapped_record(trainer.model)
    optimizer = trainer.optimizer
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    auto = record.auto  # None unless checkpoint="auto"
    kept = (auto.report.get("kept_blocks") if auto is not None and auto.report
            else sum(not b.checkpoint for b in record.plan.blocks))
    return dict(kept_blocks=f"{kept}/{len(record.plan.blocks)}", compiled=compiled_blocks(trainer.model),
                offload_params=record.plan.offload.params, optimizer=type(optimizer).__name__,
                offload_fraction=getattr(optimizer, "offload_fraction", None),
                step_in_backward=getattr(optimizer, "step_in_backward", None))


def fsdp2_units(trainer: transformers.Trainer) -> int:
    """How many modules accelerate sharded with ``fully_shard`` (the decoder layers, the embedding, the tail, the root).

    accelerate applies FSDP on GPUs only: a job of CPU processes stays ``MULTI_CPU`` (``AcceleratorState`` sets
    ``DistributedType.FSDP`` only for the multi-GPU kinds), so Trainer trains it with DDP over gloo. There ``0``
    is expected (the CPU run is a smoke test of this script); on GPUs it is an error.
    """
    from torch.distributed.fsdp import FSDPModule

    units = sum(isinstance(module, FSDPModule) for module in trainer.model_wrapped.modules())
    if units == 0 and torch.cuda.is_available():
        raise SystemExit("--engine fsdp2: accelerate did not shard the model with FSDP2; the timings would be of "
                         "something else")
    return units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser, SIZES)
    parser.add_argument("--trainer", default="sft", choices=["hf", "sft"])
    parser.add_argument("--engine", default="bmtwrap", choices=["bmtwrap", "fsdp2"])
    parser.add_argument("--bmtwrap-checkpoint", default="args", choices=["args", "auto"],
                        help="bmtwrap's checkpointing: what the arguments' gradient_checkpointing means (args), or "
                             "wrap_options={'checkpoint': 'auto'}: the blocks that fit are kept")
    parser.add_argument("--fsdp-checkpointing", default="true", choices=["true", "false"],
                        help="the FSDP2 peer's gradient_checkpointing (transformers' own, every decoder layer)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))

    torch.manual_seed(0)  # every rank builds the same weights
    config = transformers.LlamaConfig(max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa",
                                      **shape(args, SIZES))
    # On its GPU: torchrun gives each process one CPU thread, and an 8B model's initialisation on one thread takes
    # minutes. The peak memory is counted from the start of training, after the model is sharded.
    with torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    per_token = flops_per_token(config, model, args.seq)
    rows = args.batch * world * (args.warmup + args.steps)
    ids = torch.randint(0, config.vocab_size, (rows, args.seq), generator=torch.Generator().manual_seed(1)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids} if args.trainer == "sft" else
                                      {"input_ids": ids, "labels": ids})

    common = dict(output_dir=tempfile.mkdtemp(prefix="trainer_llama_"), per_device_train_batch_size=args.batch,
                  max_steps=args.warmup + args.steps, learning_rate=1e-5, max_grad_norm=1.0, bf16=True,
                  use_cpu=not cuda, logging_strategy="no", save_strategy="no", eval_strategy="no",
                  report_to="none", disable_tqdm=True, seed=0)
    if args.engine == "fsdp2":
        common.update(fsdp2_options(args.fsdp_checkpointing == "true"))
    if args.trainer == "sft":
        import trl

        config_args = trl.SFTConfig(max_length=args.seq, **common)
        trainer_class = trl.SFTTrainer
        if args.engine == "bmtwrap":
            from bmtwrap.hf import SFTTrainer as trainer_class
        extra: Dict[str, Any] = {}
    else:
        config_args = transformers.TrainingArguments(**common)
        trainer_class = transformers.Trainer
        if args.engine == "bmtwrap":
            from bmtwrap.hf import Trainer as trainer_class
        extra = dict(data_collator=transformers.default_data_collator)
    checkpointing = bool(config_args.gradient_checkpointing)  # read before bmtwrap's Trainer switches it off
    timer = StepTimer()
    row: Dict[str, Any] = dict(trainer=args.trainer, engine=args.engine, size=args.size, batch=args.batch,
                               seq=args.seq, world=world, gradient_checkpointing=checkpointing)
    if args.engine == "fsdp2":
        row["peer_checkpointing"] = "transformers, every decoder layer" if checkpointing else "none"
    if args.engine == "bmtwrap" and args.bmtwrap_checkpoint == "auto":
        extra["wrap_options"] = dict(checkpoint="auto")
        config_args.gradient_checkpointing = False
        row["bmtwrap_checkpoint"] = "auto"
    try:
        trainer = trainer_class(model=model, args=config_args, train_dataset=data, processing_class=tokenizer(),
                                callbacks=[timer], **extra)
        trainer.train()
    except torch.OutOfMemoryError as error:
        print("RESULT " + json.dumps(dict(row, oom=True, rank=rank, error=str(error).split("\n")[0])), flush=True)
        os._exit(0)  # the other ranks may wait in a collective for this one: do not wait for them in turn

    times = timer.times[args.warmup:]
    step_s = statistics.median(times)
    tokens = args.batch * args.seq
    peaks = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()] if cuda else [0, 0],
                         dtype=torch.float64, device=trainer.args.device)
    torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    if args.engine == "bmtwrap":
        row["bmtwrap"] = bmtwrap_choices(trainer)
    else:
        row["fsdp2_units"] = fsdp2_units(trainer)
    row.update(steps=len(times), step_s=round(step_s, 4), tokens_per_s_per_gpu=round(tokens / step_s, 1),
               mfu=round(per_token * tokens / step_s / PEAK_FLOPS, 4) if cuda else None,
               peak_gib=round(peaks[0].item() / 2**30, 2), reserved_gib=round(peaks[1].item() / 2**30, 2),
               step_times=[round(t, 3) for t in timer.times])
    if rank == 0:
        print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
