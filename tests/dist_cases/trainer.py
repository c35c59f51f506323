"""bmtwrap.hf.Trainer over gloo, against plain transformers.Trainer in one process.

Two ways to run it, sharing the scenarios below:

- under torchrun (``launch.run_cases("trainer.py", 2, WORK)``): bmtwrap's Trainer on 2 ranks,
  each with half of every global batch; it writes each scenario's log history and final
  parameters into WORK, the saved folders too, and reports what only it can check (resume,
  best model, errors that need a process group);
- as ``python trainer.py OUT WORK --reference`` with no torchrun variables: plain
  ``transformers.Trainer`` in one process on the whole batch (bmtwrap is not imported), writing
  the same files; then it loads bmtwrap's saved folders with plain transformers and peft.

Both record, before every optimizer step, the trainable parameters and the gradients the optimizer reads
(``{name}.bmt.steps.pt``, ``{name}.ref.steps.pt``); the reference then computes plain Trainer's gradient at
bmtwrap's parameters before each step, on the batches it trained on, with what bounds its rounding.

The test compares the two. Every sequence has the same length and every token is a label, so
each rank's share of a batch holds the same number of label tokens.
"""

from __future__ import annotations

import functools
import gc
import json
import shutil
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple
from unittest import mock

import torch
import transformers as T

WORK = Path(sys.argv[2])
REFERENCE = "--reference" in sys.argv
LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
LORA_RANK = 4
BATCH, EVAL_BATCH, SEQ = 8, 4, 16  # global batch sizes; sequence length
PROMPTS = torch.tensor([[5, 17, 33, 2, 60], [41, 8, 19, 77, 3]])  # one per rank for generate()
PROBE = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(11))  # inputs for logits

T.logging.set_verbosity_error()


class Tokens(torch.utils.data.Dataset):
    """Fixed-length random token sequences, each its own labels."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, 96, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


TRAIN, EVAL = Tokens(32, seed=5), Tokens(8, seed=6)


def make_model(seed: int = 0, **config: Any) -> T.LlamaForCausalLM:
    torch.manual_seed(seed)
    return T.LlamaForCausalLM(T.LlamaConfig(**{**LLAMA, **config}))


def make_lora(model: T.LlamaForCausalLM) -> Any:
    import peft

    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=LORA_RANK, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def training_args(name: str, world: int, **overrides: Any) -> T.TrainingArguments:
    """The same run at any world size: per-device batches are the global ones split over ranks."""
    base = dict(output_dir=str(WORK / name), per_device_train_batch_size=BATCH // world,
                per_device_eval_batch_size=EVAL_BATCH // world, max_steps=4, logging_steps=1, learning_rate=1e-2,
                weight_decay=0.1, seed=3, use_cpu=not torch.cuda.is_available(), report_to=[], disable_tqdm=True,
                save_strategy="no")
    return T.TrainingArguments(**{**base, **overrides})


# Compared with plain Trainer: name -> (TrainingArguments overrides, bmtwrap Trainer options, LoRA?).
SCENARIOS: Dict[str, Tuple[Dict[str, Any], Dict[str, Any], bool]] = {
    "accumulate_and_clip": (dict(gradient_accumulation_steps=2, max_grad_norm=0.5), {}, False),
    "no_clipping": (dict(max_grad_norm=0.0, max_steps=3), {}, False),
    "offload": (dict(max_steps=3), dict(offload=True), False),
    "lora": (dict(max_steps=3), {}, True),
}


def losses(trainer: T.Trainer) -> List[List[float]]:
    """[step, loss, grad_norm] of every logged training step."""
    return [[h["step"], h["loss"], h["grad_norm"]] for h in trainer.state.log_history if "loss" in h]


Tensors = Dict[str, torch.Tensor]


class RecordSteps(T.TrainerCallback):
    """Before every optimizer step: each trainable parameter and its gradient as the optimizer reads it (summed
    over micro-batches and ranks, clipped), at full shape, and each param group's learning rate.

    ``gather(model)`` returns the parameters and the gradients (on every rank under torchrun: a collective).
    """

    def __init__(self, gather: Callable[[torch.nn.Module], Tuple[Tensors, Tensors]]) -> None:
        self.gather = gather
        self.steps: List[Dict[str, Any]] = []

    def on_pre_optimizer_step(self, args: T.TrainingArguments, state: T.TrainerState, control: Any,
                              model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        params, grads = self.gather(model)
        self.steps.append({"params": params, "grads": grads, "lr": [g["lr"] for g in optimizer.param_groups]})


# --- plain transformers.Trainer in one process --------------------------------------------------------


def plain_params_and_grads(model: torch.nn.Module) -> Tuple[Tensors, Tensors]:
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return ({name: p.detach().clone() for name, p in trainable},
            {name: p.grad.detach().clone() for name, p in trainable})


class RecordingTrainer(T.Trainer):
    """Plain Trainer that keeps every micro-batch it trains on, by optimizer step, with the token count it
    divides the loss by."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batches: List[List[Tuple[Tensors, Any]]] = []

    def training_step(self, model: torch.nn.Module, inputs: Tensors, num_items_in_batch: Any = None) -> torch.Tensor:
        while len(self.micro_batches) <= self.state.global_step:
            self.micro_batches.append([])
        self.micro_batches[self.state.global_step].append((dict(inputs), num_items_in_batch))
        return super().training_step(model, inputs, num_items_in_batch)


class AbsoluteTerms:
    """While active (a context manager), sums for every trainable weight the absolute values of the terms its
    gradient adds up, in float64 from the fp32 factors (see [Note: the gradient's rounding bound] in
    tests/test_trainer.py), and counts the terms of each element.

    A Linear's weight gradient is dY^T X over the tokens: |dY|^T |X|. An RMSNorm's weight gradient sums
    dY * x_normed: |dY| |x_normed|. An Embedding's row i sums, over the tokens of id i, the gradient of the
    residual stream at the first layer, itself the sum of what each residual branch passes back: the
    absolute values of those. Every branch starts with an RMSNorm (the decoder layers' two, the final one),
    so the stream's gradient at one norm's input less that at the next norm's input is the branch between.
    Only tensor hooks: a module's backward hook would add nodes to autograd's graph, and change the order in
    which it sums a tensor's gradients.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.sums: Tensors = {}
        self.counts: Dict[str, int] = {}
        self._stream: List[Optional[torch.Tensor]] = []  # the residual stream's gradient at each norm's input
        self._handles: List[Any] = []
        params = dict(model.named_parameters())
        for module_name, module in model.named_modules():
            own = {n: f"{module_name}.{n}" if module_name else n
                   for n, p in module.named_parameters(recurse=False) if p.requires_grad}
            if not own:
                continue
            for name in own.values():
                self.sums[name] = torch.zeros_like(params[name], dtype=torch.float64)
                self.counts[name] = 0
            if isinstance(module, torch.nn.Linear):
                hook = self._linear
            elif isinstance(module, torch.nn.Embedding):
                hook = self._embedding
                self._handles += [m.register_forward_pre_hook(self._stream_point) for m in model.modules()
                                  if type(m).__name__.endswith("RMSNorm")]
            elif type(module).__name__.endswith("RMSNorm"):
                hook = self._rms_norm
            else:
                raise NotImplementedError(f"{module_name} ({type(module).__name__}) has trainable parameters "
                                          f"{sorted(own)}: no sum of absolute terms for it")
            self._handles.append(module.register_forward_hook(functools.partial(hook, own)))

    def __enter__(self) -> "AbsoluteTerms":
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def _add(self, name: str, terms: torch.Tensor, count: int) -> None:
        self.sums[name] += terms
        self.counts[name] += count

    @staticmethod
    def _rows(t: torch.Tensor) -> torch.Tensor:
        return t.detach().double().reshape(-1, t.shape[-1])  # (tokens, features)

    def _linear(self, names: Dict[str, str], module: torch.nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        x = self._rows(args[0]).abs()  # (tokens, in)

        def add(dy: torch.Tensor) -> None:
            dy = self._rows(dy).abs()  # (tokens, out)
            self._add(names["weight"], dy.T @ x, dy.shape[0])
            if "bias" in names:
                self._add(names["bias"], dy.sum(0), dy.shape[0])

        output.register_hook(add)

    def _rms_norm(self, names: Dict[str, str], module: torch.nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        x = self._rows(args[0])
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).abs()
        output.register_hook(lambda dy: self._add(names["weight"], (self._rows(dy).abs() * normed).sum(0),
                                                  normed.shape[0]))

    def _stream_point(self, module: torch.nn.Module, args: Tuple[Any, ...]) -> None:
        index = len(self._stream)
        self._stream.append(None)
        if index > 0:  # the first norm's input is the embedding's output: its gradient is the embedding's dy
            args[0].register_hook(lambda grad: self._stream.__setitem__(index, self._rows(grad)))

    def _embedding(self, names: Dict[str, str], module: torch.nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        ids = args[0].reshape(-1)
        self._stream.clear()  # the norms of this forward follow

        def add(dy: torch.Tensor) -> None:  # the last gradient of this backward: every branch has passed back
            stream = [self._rows(dy), *self._stream[1:]]
            branches = sum((a - b).abs() for a, b in zip(stream, stream[1:])) + stream[-1].abs()
            self._add(names["weight"], torch.zeros_like(self.sums[names["weight"]]).index_add_(0, ids, branches),
                      len(stream) * ids.numel())

        output.register_hook(add)


def rounding_depth(config: T.LlamaConfig, lora_rank: int = 0) -> int:
    """The most roundings on a path from the input to the loss and back, which bounds how many make one factor
    of a gradient's term (see [Note: the gradient's rounding bound] in tests/test_trainer.py)."""
    hidden, heads, vocab = config.hidden_size, config.num_attention_heads, config.vocab_size
    norm = hidden + 4  # sum of squares, mean and epsilon, rsqrt, two products
    projection = hidden + (lora_rank + 2 if lora_rank else 0)  # an adapter beside it: down, up, scale, add
    attention = projection + 3 + hidden // heads + (SEQ + 3) + SEQ + hidden + 1  # rope, q k, softmax, p v, o, add
    mlp = hidden + 4 + config.intermediate_size + 1  # gate (or up), silu and product, down, add
    head = norm + hidden + vocab + 6  # final norm, lm_head, log-softmax, the mean over tokens
    return 2 * (config.num_hidden_layers * (2 * norm + attention + mlp) + head)  # forward, then backward


def gradient_at(trainer: RecordingTrainer, params: Tensors, micro_batches: List[Tuple[Tensors, Any]]) -> Dict[str, Any]:
    """Plain Trainer's gradient at ``params`` on one optimizer step's micro-batches: summed (``raw``), the norm it
    clips by and clipped (``clipped``), with each element's sum of absolute terms and their number."""
    model = trainer.model
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in params.items():
            named[name].copy_(value)
    model.zero_grad(set_to_none=True)
    with AbsoluteTerms(model) as terms:
        for inputs, items in micro_batches:
            trainer.training_step(model, inputs, items)
    _, raw = plain_params_and_grads(model)
    max_norm = trainer.args.max_grad_norm
    norm = trainer.accelerator.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    _, clipped = plain_params_and_grads(model)
    model.zero_grad(set_to_none=True)
    return {"raw": raw, "clipped": clipped, "norm": float(norm), "terms": terms.sums, "counts": terms.counts}


def reference() -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, (overrides, _, lora) in SCENARIOS.items():
        model = make_lora(make_model()) if lora else make_model()
        record = RecordSteps(plain_params_and_grads)
        trainer = RecordingTrainer(model=model, args=training_args(f"ref_{name}", 1, **overrides),
                                   train_dataset=TRAIN, eval_dataset=EVAL, callbacks=[record])
        trainer.train()
        out[name] = {"losses": losses(trainer), "eval_loss": trainer.evaluate()["eval_loss"]}
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, WORK / f"{name}.ref.pt")
        # Then plain Trainer's gradient at bmtwrap's parameters before each of its steps, on the same batches.
        ours = torch.load(WORK / f"{name}.bmt.steps.pt")
        names = {id(p): n for n, p in model.named_parameters()}
        torch.save({
            "steps": record.steps,
            "at_ours": [gradient_at(trainer, step["params"], batches)
                        for step, batches in zip(ours, trainer.micro_batches)],
            "groups": [{"names": [names[id(p)] for p in group["params"]], "weight_decay": group["weight_decay"],
                        "betas": group["betas"], "eps": group["eps"]} for group in trainer.optimizer.param_groups],
            "max_grad_norm": trainer.args.max_grad_norm,
            "depth": rounding_depth(model.config, LORA_RANK if lora else 0),
        }, WORK / f"{name}.ref.steps.pt")
    out["loaded_model"] = reported(load_saved_model)
    out["loaded_adapter"] = reported(load_saved_adapter)
    return out


def reported(check: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    try:
        return check()
    except Exception:  # reported to the tests that need it; the other comparisons stand on their own
        return {"error": traceback.format_exc()}


@torch.no_grad()
def load_saved_model() -> Dict[str, Any]:
    """What plain transformers makes of the folder bmtwrap's save_model wrote."""
    loaded = T.AutoModelForCausalLM.from_pretrained(WORK / "saved_model").eval()
    trained = torch.load(WORK / "accumulate_and_clip.bmt.pt")
    logits = torch.load(WORK / "probe_model.bmt.pt")["logits"]
    return {"weights_equal": all(torch.equal(trained[k], v) for k, v in loaded.state_dict().items()),
            "keys_equal": sorted(trained) == sorted(loaded.state_dict()),
            "logits_max_abs": (loaded(PROBE).logits - logits).abs().max().item(),
            "generated": [loaded.generate(PROMPTS[r : r + 1], max_new_tokens=6, do_sample=False,
                                          pad_token_id=0)[0].tolist() for r in range(len(PROMPTS))],
            "tokenizer_saved": (WORK / "saved_model" / "tokenizer_config.json").is_file()}


@torch.no_grad()
def load_saved_adapter() -> Dict[str, Any]:
    """What peft makes of the adapter folder bmtwrap's save_model wrote, on the untrained base."""
    import peft

    adapter = peft.PeftModel.from_pretrained(make_model(), WORK / "saved_adapter").eval()
    logits = torch.load(WORK / "probe_adapter.bmt.pt")["logits"]
    return {"logits_max_abs": (adapter(PROBE).logits - logits).abs().max().item()}


if REFERENCE:
    Path(sys.argv[1]).write_text(json.dumps(reference(), indent=1))
    gc.freeze()  # written: the exit need not collect garbage over every loaded object (2 s on two cores)
    sys.exit(0)

# --- bmtwrap's Trainer under torchrun ---------------------------------------------------------------------

import bmtwrap as bmt  # noqa: E402  (the reference above must run without bmtwrap)
from accelerate import Accelerator  # noqa: E402
from bmtwrap.hf import SHARDED_FOLDER, Trainer  # noqa: E402
from common import run  # noqa: E402


def tokenizer() -> T.PreTrainedTokenizerFast:
    """A word-level tokenizer over the 96 ids, only to check that save_model writes it."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(96)}
    return T.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                     unk_token="t0", pad_token="t0")


def args_for(name: str, **overrides: Any) -> T.TrainingArguments:
    return training_args(name, bmt.world_size(), **overrides)


def save_on_rank0(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    if bmt.rank() == 0:
        torch.save({k: v.cpu() for k, v in tensors.items()}, path)


def sharded_params_and_grads(model: torch.nn.Module) -> Tuple[Tensors, Tensors]:
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    params = bmt.full_state_dict(model, with_buffers=False, select=trainable.__contains__)
    grads = {name: grad for name, grad in bmt.full_grad_dict(model).items() if name in trainable}
    return params, grads


TRAINED: Dict[str, Trainer] = {}  # each scenario's Trainer, for the cases that save its model


def scenario(name: str) -> Callable[[], Dict[str, Any]]:
    overrides, options, lora = SCENARIOS[name]

    def case() -> Dict[str, Any]:
        model = make_lora(make_model()) if lora else make_model()
        args = args_for(f"bmt_{name}", **overrides)
        record = RecordSteps(sharded_params_and_grads)
        trainer = Trainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=EVAL, callbacks=[record],
                          processing_class=tokenizer() if name == "accumulate_and_clip" else None, **options)
        trainer.train()
        if bmt.rank() == 0:
            torch.save(record.steps, WORK / f"{name}.bmt.steps.pt")
        result = {"losses": losses(trainer), "eval_loss": trainer.evaluate()["eval_loss"],
                  "ddp": any(isinstance(m, torch.nn.parallel.DistributedDataParallel)
                             for m in (trainer.model, trainer.model_wrapped)),
                  "optimizer": type(trainer.optimizer.optimizer).__name__}
        save_on_rank0(bmt.full_state_dict(model), WORK / f"{name}.bmt.pt")
        TRAINED[name] = trainer
        return result

    return case


@torch.no_grad()
def save_model_and_generate() -> Dict[str, Any]:
    trainer = TRAINED["accumulate_and_clip"]
    trainer.save_model(str(WORK / "saved_model"))
    model = trainer.model.eval()
    device = trainer.args.device
    mine = model.generate(PROMPTS[bmt.rank() : bmt.rank() + 1].to(device), max_new_tokens=6, do_sample=False,
                          pad_token_id=0)
    every = [torch.zeros_like(mine) for _ in range(bmt.world_size())]
    torch.distributed.all_gather(every, mine)
    save_on_rank0({"logits": model(PROBE.to(device)).logits}, WORK / "probe_model.bmt.pt")
    return {"generated": [g[0].tolist() for g in every]}


@torch.no_grad()
def save_adapter() -> Dict[str, Any]:
    trainer = TRAINED["lora"]
    model = trainer.model
    base_before = make_model().state_dict()
    full = bmt.full_state_dict(model)
    base_after = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in full.items()
                  if "lora_" not in k}
    trainer.save_model(str(WORK / "saved_adapter"))
    save_on_rank0({"logits": model.eval()(PROBE.to(trainer.args.device)).logits},
                  WORK / "probe_adapter.bmt.pt")
    files = sorted(p.name for p in (WORK / "saved_adapter").iterdir())
    return {"base_frozen": all(torch.equal(base_before[k], v.cpu()) for k, v in base_after.items()),
            "lora_b_trained": all(v.abs().max().item() > 0 for k, v in full.items() if "lora_B" in k),
            "adapter_files": files}


class KeepCheckpoint(T.TrainerCallback):
    """Copies ``checkpoint-<step>`` aside once it is written (rotation deletes it later)."""

    def __init__(self, step: int, to: Path) -> None:
        self.step, self.to = step, to

    def on_save(self, args: T.TrainingArguments, state: T.TrainerState, control: Any, **kwargs: Any) -> None:
        if state.global_step != self.step:
            return
        bmt.synchronize()  # every rank has written its files (its RNG state last)
        if bmt.rank() == 0:
            shutil.copytree(Path(args.output_dir) / f"checkpoint-{self.step}", self.to / f"checkpoint-{self.step}")
        bmt.synchronize()


def resume() -> Dict[str, Any]:
    """6 steps saving every 3 (keeping 1), against a fresh Trainer resuming from checkpoint-3."""
    overrides = dict(max_steps=6, save_strategy="steps", save_steps=3, save_total_limit=1)
    dropout = dict(attention_dropout=0.1)  # so resuming must restore every rank's RNG too
    first = Trainer(model=make_model(**dropout), args=args_for("resume_first", **overrides),
                    train_dataset=TRAIN, callbacks=[KeepCheckpoint(3, WORK / "kept")])
    first.train()
    uninterrupted = bmt.full_state_dict(first.model)
    bmt.synchronize()
    # Other initial weights: everything must come from the checkpoint.
    second = Trainer(model=make_model(seed=1, **dropout), args=args_for("resume_second", **overrides),
                     train_dataset=TRAIN)
    second.train(resume_from_checkpoint=str(WORK / "kept" / "checkpoint-3"))
    resumed = bmt.full_state_dict(second.model)
    folder = WORK / "kept" / "checkpoint-3"
    return {"uninterrupted": [x for x in losses(first) if x[0] > 3],
            "resumed": [x for x in losses(second) if x[0] > 3],
            "param_max_abs": max((uninterrupted[k] - resumed[k]).abs().max().item() for k in uninterrupted),
            "first_run_folders": sorted(p.name for p in (WORK / "resume_first").iterdir() if p.is_dir()),
            "checkpoint_files": sorted(p.name for p in folder.iterdir()),
            "sharded_index": (folder / SHARDED_FOLDER / "index.json").is_file()}


def save_only_model() -> Dict[str, Any]:
    """save_only_model=True: the checkpoint holds the model, no optimizer or scheduler state."""
    args = args_for("save_only_model", max_steps=1, save_strategy="steps", save_steps=1, save_only_model=True)
    Trainer(model=make_model(), args=args, train_dataset=TRAIN).train()
    index = json.loads((WORK / "save_only_model" / "checkpoint-1" / SHARDED_FOLDER / "index.json").read_text())
    return {"optimizers": index["optimizers"], "model_keys": len(index["model"])}


def best_model() -> Dict[str, Any]:
    """load_best_model_at_end; the eval loss rises on these random tokens, so the best is not the last."""
    saved: Dict[int, Dict[str, torch.Tensor]] = {}

    class Record(T.TrainerCallback):
        def on_save(self, args: Any, state: T.TrainerState, control: Any, model: Any = None, **kwargs: Any) -> None:
            saved[state.global_step] = bmt.full_state_dict(model)  # a collective: every rank saves

    overrides = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                     load_best_model_at_end=True, metric_for_best_model="eval_loss")
    trainer = Trainer(model=make_model(), args=args_for("best_model", **overrides), train_dataset=TRAIN,
                      eval_dataset=EVAL, callbacks=[Record()])
    trainer.train()
    final = bmt.full_state_dict(trainer.model)
    best = int(trainer.state.best_model_checkpoint.rsplit("-", 1)[1])
    return {"best_step": best, "saved_steps": sorted(saved),
            "final_is_best": all(torch.equal(final[k], v) for k, v in saved[best].items()),
            "final_is_last": all(torch.equal(final[k], v) for k, v in saved[max(saved)].items())}


def gradient_checkpointing() -> Dict[str, Any]:
    """args.gradient_checkpointing becomes bmtwrap's checkpointing; Hugging Face's stays off."""
    from bmtwrap.wrap.convert import wrapped_record

    args = args_for("gradient_checkpointing", max_steps=1, gradient_checkpointing=True)
    trainer = Trainer(model=make_model(), args=args, train_dataset=TRAIN)
    trainer.train()
    return {"flag_off": not args.gradient_checkpointing and not getattr(args, "activation_checkpointing", False),
            "hf_checkpointing_off": not any(getattr(m, "gradient_checkpointing", False)
                                            for m in trainer.model.modules()),
            "wrap_checkpoint": wrapped_record(trainer.model).options.checkpoint}


def chosen_optimizer_and_bf16() -> Dict[str, Any]:
    """optimizer_cls_and_kwargs= is honoured whatever args.optim says; bf16 trains through autocast."""
    sgd = Trainer(model=make_model(), args=args_for("sgd", max_steps=2, optim="adafactor"),
                  train_dataset=TRAIN, optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))
    sgd.train()
    bf16 = Trainer(model=make_model(), args=args_for("bf16", max_steps=2, bf16=True), train_dataset=TRAIN)
    bf16.train()
    return {"optimizer": type(sgd.optimizer.optimizer).__name__, "sgd_losses": losses(sgd), "bf16_losses": losses(bf16)}


def error_text(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:  # the message is what the case reports
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def errors() -> Dict[str, str]:
    """The refusals that need a process group (the others are tested in one process)."""
    out: Dict[str, str] = {}
    gpus = args_for("errors")
    gpus.device  # set up, then pretend this process sees two GPUs
    gpus._n_gpu = 2
    out["n_gpu"] = error_text(lambda: Trainer(model=make_model(), args=gpus, train_dataset=TRAIN))
    elsewhere = args_for("errors")
    elsewhere.device  # set up, then pretend accelerate put this process on a GPU
    elsewhere.__dict__["_setup_devices"] = torch.device("cuda", bmt.rank())
    out["device"] = error_text(lambda: Trainer(model=make_model(), args=elsewhere, train_dataset=TRAIN))
    (WORK / "not_a_checkpoint").mkdir(exist_ok=True)
    trainer = Trainer(model=make_model(), args=args_for("errors"), train_dataset=TRAIN)
    out["resume"] = error_text(lambda: trainer.train(resume_from_checkpoint=str(WORK / "not_a_checkpoint")))

    # accelerate turns FSDP on from an `accelerate launch` config only on GPUs: here an Accelerator
    # whose state carries an FSDP plugin stands in for it.
    class FSDPAccelerator(Accelerator):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.state = SimpleNamespace(fsdp_plugin=SimpleNamespace(activation_checkpointing=False),
                                         deepspeed_plugin=None)

    with mock.patch.object(T.trainer, "Accelerator", FSDPAccelerator):
        out["accelerate_fsdp"] = error_text(lambda: Trainer(model=make_model(), args=args_for("errors"),
                                                            train_dataset=TRAIN))
    # Last: it leaves accelerate set up for one process (the next TrainingArguments would reset it).
    no_cpu = T.TrainingArguments(output_dir=str(WORK / "errors"), use_cpu=False, report_to=[])
    out["world_size"] = error_text(lambda: Trainer(model=make_model(), args=no_cpu, train_dataset=TRAIN))
    return out


if __name__ == "__main__":
    run({**{name: scenario(name) for name in SCENARIOS}, "save_model_and_generate": save_model_and_generate,
         "save_adapter": save_adapter, "resume": resume, "save_only_model": save_only_model,
         "best_model": best_model,
         "gradient_checkpointing": gradient_checkpointing, "chosen_optimizer_and_bf16": chosen_optimizer_and_bf16,
         "errors": errors})
