"""bmtwrap.hf's SFTTrainer and DPOTrainer over gloo, against TRL's own trainers in one process.

Two ways to run it, sharing the scenarios below:

- under torchrun (``launch.run_cases("trl_trainers.py", 2, WORK)``): bmtwrap's trainers on 2
  ranks, each with half of every global batch; each scenario's logged losses and its final
  parameters (``{name}.bmt.pt``) go into WORK, with the folders save_model and the checkpoints wrote;
- as ``python trl_trainers.py OUT WORK --reference`` with no torchrun variables: TRL's
  ``SFTTrainer`` and ``DPOTrainer`` on the unwrapped model in one process on the whole batch
  (bmtwrap is not imported), writing ``{name}.ref.pt``; then it loads bmtwrap's saved folder with
  plain transformers.

The sequences have different lengths (padding, and another number of label tokens on each rank),
and TRL's configs keep their default gradient_checkpointing=True (bmtwrap's checkpointing).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL's trainers ping the Hub otherwise

import torch  # noqa: E402
import transformers as T  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import DPOConfig, SFTConfig  # noqa: E402

WORK = Path(sys.argv[2])
REFERENCE = "--reference" in sys.argv
LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
BATCH = 8  # global batch size
STEPS = 4

T.logging.set_verbosity_error()


def tokenizer() -> T.PreTrainedTokenizerFast:
    """Words t0..t95 are the ids 0..95; t0 pads, t1 ends a sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0", eos_token="t1")


def texts(n: int, lengths: range, seed: int) -> List[str]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths.start, lengths.stop, (n,), generator=g)
    return [" ".join(f"t{int(i)}" for i in torch.randint(2, 96, (int(k),), generator=g)) for k in sizes]


SFT_DATA = Dataset.from_dict({"text": texts(32, range(4, 14), seed=5)})
# A tiny preference set: a prompt, a preferred and a rejected completion of other lengths.
DPO_DATA = Dataset.from_dict({"prompt": texts(32, range(3, 7), seed=6), "chosen": texts(32, range(2, 6), seed=7),
                              "rejected": texts(32, range(2, 8), seed=8)})


def pairs_on_disk(world: int) -> Dataset:
    """DPO_DATA saved and loaded back: precompute_ref_log_probs caches the log-probabilities next to the
    dataset's files, where every rank reads what rank 0 wrote (an in-memory dataset has its cache in each
    process's own temporary folder). One copy per world size, so that each run computes its own."""
    from datasets import load_from_disk

    folder = WORK / f"dpo_pairs.w{world}"
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        DPO_DATA.save_to_disk(str(folder))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return load_from_disk(str(folder))


def make_model(seed: int = 0) -> T.LlamaForCausalLM:
    torch.manual_seed(seed)
    return T.LlamaForCausalLM(T.LlamaConfig(**LLAMA))


def lora(**options: Any) -> Any:
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **options)


def trained_adapter() -> Any:
    """A peft model whose adapter is not zero (as if trained before): DPO trains it against a frozen copy."""
    import peft

    torch.manual_seed(1)
    return peft.get_peft_model(make_model(), lora(init_lora_weights=False))


def common(name: str, world: int, **overrides: Any) -> Dict[str, Any]:
    """The same run at any world size: per-device batches are the global one split over ranks."""
    base = dict(output_dir=str(WORK / f"{name}.w{world}"), per_device_train_batch_size=BATCH // world, max_steps=STEPS,
                logging_steps=1, learning_rate=1e-3, seed=3, use_cpu=True, report_to=[], disable_tqdm=True,
                save_strategy="no", bf16=False)
    return {**base, **overrides}


def losses(trainer: T.Trainer) -> List[List[float]]:
    """[step, loss, grad_norm] of every logged training step."""
    return [[h["step"], h["loss"], h["grad_norm"]] for h in trainer.state.log_history if "loss" in h]


def scenarios(sft: Callable[..., Any], dpo: Callable[..., Any], world: int) -> Dict[str, Callable[[], Any]]:
    """Each compared scenario: name -> a function that builds its trainer with these classes."""
    return {
        # Saves checkpoint-2, which the resume case continues from.
        "sft": lambda: sft(model=make_model(), args=SFTConfig(**common("sft", world, save_strategy="steps",
                                                                             save_steps=2)),
                           train_dataset=SFT_DATA, processing_class=tokenizer()),
        # One row per rank holding its sequences end to end, told apart by position_ids.
        "sft_padding_free": lambda: sft(model=make_model(), args=SFTConfig(**common("sft_padding_free", world,
                                                                                     padding_free=True,
                                                                                     max_length=None)),
                                        train_dataset=SFT_DATA, processing_class=tokenizer()),
        "dpo": lambda: dpo(model=make_model(), ref_model=make_model(), args=DPOConfig(**common("dpo", world)),
                           train_dataset=DPO_DATA, processing_class=tokenizer()),
        # The reference log-probabilities computed once, by the model before training.
        "dpo_precomputed": lambda: dpo(model=make_model(), args=DPOConfig(**common("dpo_precomputed", world,
                                                                                   precompute_ref_log_probs=True)),
                                       train_dataset=pairs_on_disk(world), processing_class=tokenizer()),
        # The reference is the model with its adapters disabled.
        "dpo_lora": lambda: dpo(model=make_model(), args=DPOConfig(**common("dpo_lora", world)),
                                train_dataset=DPO_DATA, processing_class=tokenizer(), peft_config=lora()),
        # The reference is the model with TRL's frozen copy of the adapter ("ref") active.
        "dpo_lora_ref_adapter": lambda: dpo(model=trained_adapter(),
                                            args=DPOConfig(**common("dpo_lora_ref_adapter", world)),
                                            train_dataset=DPO_DATA, processing_class=tokenizer()),
        # The model by its folder (the sft case's save_model): TRL loads it, and the reference model from there too.
        "dpo_from_folder": lambda: dpo(model=str(WORK / "saved_sft"),
                                       args=DPOConfig(**common("dpo_from_folder", world)),
                                       train_dataset=DPO_DATA, processing_class=tokenizer()),
    }


def reference() -> Dict[str, Any]:
    from trl import DPOTrainer, SFTTrainer

    out: Dict[str, Any] = {}
    for name, build in scenarios(SFTTrainer, DPOTrainer, 1).items():
        trainer = build()
        trainer.train()
        out[name] = {"losses": losses(trainer)}
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, WORK / f"{name}.ref.pt")
    loaded = T.AutoModelForCausalLM.from_pretrained(WORK / "saved_sft")
    trained = torch.load(WORK / "sft.bmt.pt")
    out["loaded"] = {"keys_equal": sorted(loaded.state_dict()) == sorted(trained),
                     "weights_equal": all(torch.equal(trained[k], v) for k, v in loaded.state_dict().items())}
    return out


if REFERENCE:
    Path(sys.argv[1]).write_text(json.dumps(reference(), indent=1))
    gc.freeze()  # written: the exit need not collect garbage over every loaded object (2 s on two cores)
    sys.exit(0)

# --- bmtwrap's trainers under torchrun ---------------------------------------------------------------------

import bmtwrap as bmt  # noqa: E402  (the reference above must run without bmtwrap)
from bmtwrap.hf import DPOTrainer, SFTTrainer, sharded  # noqa: E402
from bmtwrap.wrap.convert import wrapped_record  # noqa: E402
from common import run  # noqa: E402

TRAINED: Dict[str, Any] = {}


def scenario(name: str) -> Callable[[], Dict[str, Any]]:
    def case() -> Dict[str, Any]:
        trainer = scenarios(SFTTrainer, DPOTrainer, bmt.world_size())[name]()
        trainer.train()
        full = bmt.full_state_dict(trainer.model)
        if bmt.rank() == 0:
            torch.save({k: v.cpu() for k, v in full.items()}, WORK / f"{name}.bmt.pt")
        TRAINED[name] = trainer
        ref = getattr(trainer, "ref_model", None)
        record = wrapped_record(trainer.model)
        return {"losses": losses(trainer), "sharded": record is not None,
                "checkpoint": record.options.checkpoint if record is not None else None,
                "hf_checkpointing": any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules()),
                "ref_sharded": ref is not None and wrapped_record(ref) is not None,
                "ref_frozen": ref is not None and not any(p.requires_grad for p in ref.parameters()),
                "ref_eval": ref is not None and not ref.training}

    return case


def resume() -> Dict[str, Any]:
    """A fresh SFTTrainer, from other initial weights, resuming the sft case's checkpoint-2 to step 4; made by
    bmtwrap.hf.sharded (the same class as bmtwrap.hf.SFTTrainer, wrap_options stating SFTTrainer's choice)."""
    import trl

    args = SFTConfig(**common("sft_resumed", bmt.world_size(), save_steps=2))
    trainer = sharded(trl.SFTTrainer)(model=make_model(seed=1), args=args, train_dataset=SFT_DATA,
                                      processing_class=tokenizer(), wrap_options={"checkpoint": "auto"})
    trainer.train(resume_from_checkpoint=str(WORK / f"sft.w{bmt.world_size()}" / "checkpoint-2"))
    straight, resumed = bmt.full_state_dict(TRAINED["sft"].model), bmt.full_state_dict(trainer.model)
    return {"class": type(trainer).__name__, "sharded": wrapped_record(trainer.model) is not None,
            "resumed": losses(trainer), "straight": [x for x in losses(TRAINED["sft"]) if x[0] > 2],
            "param_max_abs": max((straight[k] - resumed[k]).abs().max().item() for k in straight)}


def save_model() -> Dict[str, Any]:
    TRAINED["sft"].save_model(str(WORK / "saved_sft"))
    return {"files": sorted(p.name for p in (WORK / "saved_sft").iterdir())}


def quantized_reference() -> Dict[str, Any]:
    """A reference model bmtwrap cannot shard (here: marked quantized) is refused when TRL prepares it."""
    ref = make_model()
    ref.hf_quantizer = object()
    try:
        DPOTrainer(model=make_model(), ref_model=ref, args=DPOConfig(**common("quantized", bmt.world_size())),
                   train_dataset=DPO_DATA, processing_class=tokenizer())
    except NotImplementedError as error:
        return {"error_text": str(error)}
    return {"error_text": "no error"}


if __name__ == "__main__":
    compared = ("sft", "sft_padding_free", "dpo", "dpo_precomputed", "dpo_lora", "dpo_lora_ref_adapter")
    run({**{name: scenario(name) for name in compared}, "resume": resume, "save_model": save_model,
         "dpo_from_folder": scenario("dpo_from_folder"), "quantized_reference": quantized_reference})
