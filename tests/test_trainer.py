"""bmtwrap.hf.Trainer: Hugging Face's Trainer on a sharded model, against plain transformers.Trainer.

``tests/dist_cases/trainer.py`` runs every scenario twice: with bmtwrap's Trainer at world size 2
over gloo (each rank half of every global batch), and with plain ``transformers.Trainer`` in one
separate process on the whole batch (no torchrun variables, no bmtwrap). fp32 on the CPU. Both record,
before every optimizer step, the trainable parameters and the gradients the optimizer reads; the plain
process then also computes plain Trainer's gradient at bmtwrap's parameters before each of its steps, on
the same batches. Step by step:

- gradients: bmtwrap's equal plain Trainer's at the same parameters within the rounding of fp32 sums,
  bounded elementwise (see [Note: the gradient's rounding bound]); the gradient norms likewise;
- updates: bmtwrap's parameters after each step are bit for bit AdamW, with plain Trainer's
  hyper-parameters and learning rates, replayed on bmtwrap's own gradients (tests/adamw_replay.py);
- end to end: the final parameters are within what those gradient differences allow AdamW to move them
  apart ([Note: how far apart gradients take AdamW] in tests/adamw_replay.py), losses and the gradient
  norms logged within 1e-5 relative.

Bounds are derived, not tuned: Adam divides each gradient by its own running magnitude, so a weight whose
gradient is near zero (near eps = 1e-8) moves by a sizeable part of lr on rounding noise alone, and how
much depends on how torch's kernels round on the CPU at hand (its instruction set). A fixed tolerance on
the final parameters is either too tight for some CPU or too loose to mean anything. A lost micro-batch or
a clipping coefficient from one rank's shards moves gradients far outside their bound; an update that is
not AdamW's breaks the bit-for-bit replay. Resuming is compared with the uninterrupted run and is exact.

The refusals that raise before any process group exists are tested here in one process.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("peft")

import transformers as T  # noqa: E402

from adamw_replay import U, AdamWGroup, deviation_bound, gamma, replay  # noqa: E402
from launch import TORCHRUN_VARIABLES, run_cases, run_python, run_reference  # noqa: E402

SCENARIOS = ["accumulate_and_clip", "no_clipping", "offload", "lora"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("trainer")
    ours = run_cases("trainer.py", 2, str(work))  # first: the reference loads the folders it saves
    return work, ours, run_reference("trainer.py", work)


def _case(runs, name):
    result = runs[1][name]
    assert "error" not in result, result.get("error")
    return result


def _loaded(runs, what: str):
    """What the reference process made of a folder bmtwrap's save_model wrote ("model" or "adapter")."""
    loaded = runs[2][f"loaded_{what}"]
    assert "error" not in loaded, loaded.get("error")
    return loaded


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _records(runs, name: str) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """(bmtwrap's steps, plain Trainer's records) of a scenario (see tests/dist_cases/trainer.py)."""
    _case(runs, name)  # the scenario's own error first
    work = runs[0]
    return torch.load(work / f"{name}.bmt.steps.pt"), torch.load(work / f"{name}.ref.steps.pt")


# [Note: the gradient's rounding bound]
# Each element of a weight's gradient is a sum of terms, one per token (AbsoluteTerms in
# tests/dist_cases/trainer.py says which). bmtwrap sums them in another order than plain Trainer: each rank
# half the batch, then over ranks; its loss from the hidden states in chunks. Summing n fp32 terms in any
# order is off by at most gamma_(n-1) times the sum of their absolute values, gamma_k = k u / (1 - k u),
# u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 3.1). Each term is a product of factors
# that are themselves computed in fp32, each through at most D roundings along the network (rounding_depth
# counts them from the model's shapes: every reduction on the longest path forward and back), so to first
# order and without cancellation inside a factor a term is within gamma_D of its value. Two runs each within
# gamma_(n+D) of exact arithmetic are within 2 gamma_(n+D) * sum |terms| of each other. Measured, with torch's
# AVX2 kernels and with its default ones (ATEN_CPU_CAPABILITY=default) on either side: at most 66 u times the
# sum (the embedding's rows), 10 u elsewhere, where n + D is over 1,500.
# The norm clipping divides by: |norm(a) - norm(b)| <= norm(a - b), and each fp32 norm of P elements is
# within gamma_P of exact. The clipping coefficient max_norm / (norm + 1e-6), clamped to 1, then moves by
# at most what the norm's interval allows, and its fp32 division and addition, and the multiplication by it,
# round once each.


def _gradient_bounds(plain: Dict[str, Any], step: int) -> Tuple[float, Dict[str, torch.Tensor]]:
    """How far bmtwrap's gradient norm, and its clipped gradient elementwise, may be from plain Trainer's at
    the same parameters before optimizer step ``step`` (counted from 0)."""
    forced = plain["at_ours"][step]
    raw = {name: 2 * gamma(forced["counts"][name] + plain["depth"]) * terms for name, terms in forced["terms"].items()}
    elements = sum(t.numel() for t in raw.values())
    raw_norm = math.sqrt(sum(float((t * t).sum()) for t in raw.values()))
    norm_bound = raw_norm + 2 * gamma(elements) * (forced["norm"] + raw_norm)
    max_norm = plain["max_grad_norm"]
    if max_norm <= 0:  # Trainer does not clip
        return norm_bound, raw

    def coefficient(norm: float) -> float:
        return min(1.0, max_norm / (max(norm, 0.0) + 1e-6))

    coef = coefficient(forced["norm"])
    coef_change = coefficient(forced["norm"] - norm_bound) - coefficient(forced["norm"] + norm_bound) + 4 * U * coef
    return norm_bound, {name: coef * bound + forced["raw"][name].double().abs() * coef_change
                        + 2 * U * forced["clipped"][name].double().abs() for name, bound in raw.items()}


def _worst(diff: Dict[str, torch.Tensor], bound: Dict[str, torch.Tensor]) -> Tuple[float, str]:
    """The largest diff / bound over all elements, and where."""
    ratios = {name: float((d.double() / bound[name]).nan_to_num(nan=0.0).max()) for name, d in diff.items()}
    where = max(ratios, key=ratios.get)
    return ratios[where], where


@pytest.mark.parametrize("name", SCENARIOS)
def test_both_start_alike_and_plain_gradients_are_recomputed_exactly(runs, name):
    """The first step's parameters are equal; plain Trainer's gradient recomputed at them is bit for bit the one
    it trained with (so recomputing at bmtwrap's parameters computes what plain Trainer would)."""
    ours, plain = _records(runs, name)
    start = plain["steps"][0]
    assert sorted(ours[0]["params"]) == sorted(start["params"])
    assert all(torch.equal(ours[0]["params"][k], v) for k, v in start["params"].items()), "different initial weights"
    assert all(torch.equal(plain["at_ours"][0]["clipped"][k], v) for k, v in start["grads"].items())


@pytest.mark.parametrize("name", SCENARIOS)
def test_gradients_are_plain_trainers_at_the_same_parameters(runs, name):
    ours, plain = _records(runs, name)
    logged = _case(runs, name)["losses"]
    assert len(ours) == len(plain["at_ours"]) == len(logged), "another number of optimizer steps"
    for step, (mine, forced, (_, _, norm)) in enumerate(zip(ours, plain["at_ours"], logged)):
        norm_bound, bound = _gradient_bounds(plain, step)
        assert abs(norm - forced["norm"]) <= norm_bound, \
            f"step {step + 1}: grad_norm {norm} vs plain Trainer's {forced['norm']} at the same parameters"
        diff = {k: (mine["grads"][k].double() - v.double()).abs() for k, v in forced["clipped"].items()}
        worst, where = _worst(diff, bound)
        assert worst <= 1, f"step {step + 1}: {where} is {worst:.3g} times its rounding bound from plain Trainer's"


@pytest.mark.parametrize("name", SCENARIOS)
def test_updates_are_adamw_on_our_gradients_bit_for_bit(runs, name):
    ours, plain = _records(runs, name)
    groups = [AdamWGroup(tuple(g["names"]), g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in plain["groups"]]
    replayed = replay(ours[0]["params"], [s["grads"] for s in ours], [s["lr"] for s in plain["steps"]], groups)
    final = torch.load(runs[0] / f"{name}.bmt.pt")
    after = [s["params"] for s in ours[1:]] + [{k: final[k] for k in ours[0]["params"]}]
    for step, (mine, expected) in enumerate(zip(after, replayed), start=1):
        differ = {k: int((mine[k].view(torch.int32) != v.view(torch.int32)).sum()) for k, v in expected.items()}
        assert not any(differ.values()), f"after step {step}: not AdamW's update: " \
                                         f"{ {k: n for k, n in differ.items() if n} }"


@pytest.mark.parametrize("name", SCENARIOS)
def test_same_losses_and_parameters_as_plain_trainer_in_one_process(runs, name):
    work, _, reference = runs
    ours, theirs = _case(runs, name), reference[name]
    assert [x[0] for x in ours["losses"]] == [x[0] for x in theirs["losses"]], "other steps were logged"
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(ours["losses"], theirs["losses"]):
        assert _rel(loss, ref_loss) <= 1e-5, f"step {step}: loss {loss} vs plain Trainer's {ref_loss}"
        assert _rel(norm, ref_norm) <= 1e-5, f"step {step}: grad_norm {norm} vs plain Trainer's {ref_norm}"
    assert _rel(ours["eval_loss"], theirs["eval_loss"]) <= 1e-5, (ours["eval_loss"], theirs["eval_loss"])
    assert not ours["ddp"], "the model was wrapped in DistributedDataParallel"
    mine, ref = torch.load(work / f"{name}.bmt.pt"), torch.load(work / f"{name}.ref.pt")
    assert sorted(mine) == sorted(ref)
    # Trained parameters: within what AdamW makes of the gradients' differences; the rest untouched.
    _, plain = _records(runs, name)
    trained = plain["steps"][0]["params"]
    assert all(torch.equal(mine[k], v) for k, v in ref.items() if k not in trained), "an untrained tensor changed"
    radius = []
    for step, (forced, theirs_step) in enumerate(zip(plain["at_ours"], plain["steps"])):
        _, bound = _gradient_bounds(plain, step)
        radius.append({k: bound[k] + (v.double() - theirs_step["grads"][k].double()).abs()
                       for k, v in forced["clipped"].items()})
    groups = [AdamWGroup(tuple(g["names"]), g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in plain["groups"]]
    bound = deviation_bound(trained, [s["grads"] for s in plain["steps"]], radius, [s["lr"] for s in plain["steps"]],
                            groups)
    worst, where = _worst({k: (mine[k].double() - ref[k].double()).abs() for k in trained}, bound)
    assert worst <= 1, f"{where}: final parameters {worst:.3g} times as far apart as the gradients allow"


def test_clipping_was_active(runs):
    """max_grad_norm=0.5 must have clipped (else the clipping case tests nothing)."""
    assert all(norm > 0.5 for _, _, norm in _case(runs, "accumulate_and_clip")["losses"])


def test_optimizer_is_bmtwraps(runs):
    assert _case(runs, "accumulate_and_clip")["optimizer"] == "AdamOptimizer"
    assert _case(runs, "offload")["optimizer"] == "AdamOffloadOptimizer"


def test_save_model_loads_in_plain_transformers(runs):
    _case(runs, "save_model_and_generate")  # its own error first, if save_model failed
    loaded = _loaded(runs, "model")
    assert loaded["keys_equal"] and loaded["weights_equal"], "from_pretrained does not give the trained weights"
    assert loaded["logits_max_abs"] <= 1e-5, loaded["logits_max_abs"]
    assert loaded["tokenizer_saved"], "save_model did not write the processing class"


def test_generate_on_every_rank_matches_the_saved_model(runs):
    generated = _case(runs, "save_model_and_generate")["generated"]
    assert generated == _loaded(runs, "model")["generated"]
    assert all(len(g) == 5 + 6 for g in generated)


def test_lora_trains_the_adapters_only_and_reloads_in_peft(runs):
    r = _case(runs, "save_adapter")
    assert r["base_frozen"], "a frozen base weight changed"
    assert r["lora_b_trained"], "lora_B is still zero: the adapters did not train"
    assert "adapter_model.safetensors" in r["adapter_files"] and "adapter_config.json" in r["adapter_files"]
    assert _loaded(runs, "adapter")["logits_max_abs"] <= 1e-5, _loaded(runs, "adapter")["logits_max_abs"]


def test_resume_from_checkpoint_is_exact(runs):
    r = _case(runs, "resume")
    assert [x[0] for x in r["resumed"]] == [4, 5, 6]
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(r["resumed"], r["uninterrupted"]):
        assert _rel(loss, ref_loss) <= 1e-6 and _rel(norm, ref_norm) <= 1e-6, (step, loss, ref_loss)
    assert r["param_max_abs"] <= 1e-6, r["param_max_abs"]


def test_checkpoint_folder_is_sharded_and_rotated(runs):
    r = _case(runs, "resume")
    assert r["first_run_folders"] == ["checkpoint-6"], "save_total_limit=1 should have removed checkpoint-3"
    assert r["sharded_index"]
    assert {"trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "bmtwrap"} <= set(r["checkpoint_files"])
    assert not {"model.safetensors", "optimizer.pt", "scheduler.pt"} & set(r["checkpoint_files"]), \
        "the full weights or a rank-0 optimizer file were written into the checkpoint"


def test_save_only_model_checkpoint_holds_no_optimizer(runs):
    r = _case(runs, "save_only_model")
    assert r["optimizers"] == [] and r["model_keys"] > 0, r


def test_load_best_model_at_end(runs):
    r = _case(runs, "best_model")
    assert r["saved_steps"] == [2, 4] and r["best_step"] == 2, r
    assert r["final_is_best"] and not r["final_is_last"], "the best checkpoint's weights were not loaded"


def test_gradient_checkpointing_flag_becomes_bmtwraps_checkpointing(runs):
    r = _case(runs, "gradient_checkpointing")
    assert r["flag_off"] and r["hf_checkpointing_off"] and r["wrap_checkpoint"] is True, r


def test_chosen_optimizer_is_honoured_and_bf16_trains(runs):
    r = _case(runs, "chosen_optimizer_and_bf16")
    assert r["optimizer"] == "SGD"
    fp32 = _case(runs, "no_clipping")["losses"]
    assert abs(r["bf16_losses"][0][1] - fp32[0][1]) <= 0.05, (r["bf16_losses"], fp32)


@pytest.mark.parametrize("name, pattern", [
    ("n_gpu", r"NotImplementedError: args.n_gpu=2: .*DataParallel.*torchrun --nproc_per_node=2"),
    ("device", r"ValueError: TrainingArguments put the batches on cuda:\d but bmtwrap keeps the model on cpu"),
    ("resume", r"ValueError: .*not_a_checkpoint holds no bmtwrap checkpoint \(bmtwrap/index.json\)"),
    ("accelerate_fsdp", r"NotImplementedError: accelerate is configured for DeepSpeed or FSDP"),
    ("world_size", r"ValueError: TrainingArguments see 1 process\(es\) but the process group has 2 ranks.*use_cpu"),
])
def test_refusals_that_need_a_process_group(runs, name, pattern):
    assert re.search(pattern, _case(runs, "errors")[name]), _case(runs, "errors")[name]


# --- refusals before any process group --------------------------------------------------------------------


def _tiny_model() -> T.LlamaForCausalLM:
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1))


def _args(tmp_path, **kwargs) -> T.TrainingArguments:
    return T.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


ARGUMENT_LIMITS = {
    "deepspeed": ("ds_config.json", "bmtwrap shards the model itself"),
    "fsdp": (True, "remove fsdp= and fsdp_config="),
    "fsdp_config": ({"min_num_params": 0}, "remove fsdp= and fsdp_config="),
    "fp16": (True, "use bf16=True"),
    "fp16_full_eval": (True, "casts the model with .to\\(dtype\\)"),
    "bf16_full_eval": (True, "casts the model with .to\\(dtype\\)"),
    "torch_compile": (True, "torch.compile does not trace"),
    "auto_find_batch_size": (True, "out-of-memory error on one rank"),
    "use_liger_kernel": (True, "Liger replaces the forward"),
    "accelerator_config.even_batches": (False, "leave even_batches=True"),
    "parallelism_config": ("tp=2", "remove parallelism_config"),
}


@pytest.mark.parametrize("argument", sorted(ARGUMENT_LIMITS))
def test_unsupported_training_argument(tmp_path, argument):
    from bmtwrap.hf import Trainer

    value, fix = ARGUMENT_LIMITS[argument]
    args = _args(tmp_path)
    *owner, name = argument.split(".")
    setattr(args.accelerator_config if owner else args, name, value)  # set after __post_init__'s checks
    with pytest.raises(NotImplementedError, match=rf"does not support {re.escape(argument)}={re.escape(repr(value))}: "
                                                  rf".*{fix}"):
        Trainer(model=_tiny_model(), args=args)


@pytest.mark.parametrize("fsdp", ["full_shard", "shard_grad_op offload", "full_shard auto_wrap"])
def test_fsdp_refusal_names_the_value_given(tmp_path, fsdp):
    from bmtwrap.hf import Trainer

    args = _args(tmp_path, fsdp=fsdp)  # TrainingArguments turns it into fsdp=True and an fsdp_config
    given = fsdp.replace(" auto_wrap", "")  # auto_wrap is FSDP's default wrapping, and leaves no trace
    with pytest.raises(NotImplementedError, match=rf"does not support fsdp='{given}': .*remove fsdp= and fsdp_config="):
        Trainer(model=_tiny_model(), args=args)


# Under torchrun, TrainingArguments makes the process group (accelerate, with ddp_timeout) before the
# Trainer joins it; then a second Trainer asks for a timeout the group no longer can take.
TIMEOUT_SCRIPT = """
import json, sys, warnings
import transformers as T
from bmtwrap.hf import Trainer

def timeout_warnings(**overrides):
    args = T.TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to=[], **overrides)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(model=model, args=args)
    return [[str(w.message), w.filename] for w in caught if "timeout" in str(w.message)]

print(json.dumps({"default": timeout_warnings(), "set_later": timeout_warnings(ddp_timeout=60)}))
"""


def test_ddp_timeout_warns_only_when_set_and_not_in_effect(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    # torchrun's variables for a world of one; port 0: the store of rank 0 picks a free one
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="0", OMP_NUM_THREADS="1")
    returncode, output = run_python(TIMEOUT_SCRIPT, str(tmp_path), env=env)
    assert returncode == 0, output[-6000:]
    seen = json.loads(output.splitlines()[-1])
    assert seen["default"] == [], "a warning about a timeout nobody set"
    (message, where), = seen["set_later"]
    assert re.fullmatch(r"TrainingArguments\(ddp_timeout=60\) has no effect: the process group was made before this "
                        r"Trainer, with a timeout of 1800 s; pass the timeout to what makes it .*", message), message
    assert where == "<string>", f"the warning points at {where}, not at the Trainer(...) call"


def test_model_init_is_refused(tmp_path):
    from bmtwrap.hf import Trainer

    with pytest.raises(NotImplementedError, match="does not support model_init=.*pass model= instead"):
        Trainer(args=_args(tmp_path), model_init=_tiny_model)


def test_no_model(tmp_path):
    from bmtwrap.hf import Trainer

    with pytest.raises(ValueError, match="needs model="):
        Trainer(args=_args(tmp_path))


def test_model_spread_by_device_map_is_refused(tmp_path):
    from bmtwrap.hf import Trainer

    model = _tiny_model()
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "lm_head": 1}
    with pytest.raises(NotImplementedError, match=r"device_map spreading it over \['0', '1'\].*without device_map"):
        Trainer(model=model, args=_args(tmp_path))


def test_quantized_model_is_refused(tmp_path):
    from bmtwrap.hf import Trainer

    model = _tiny_model()
    model.hf_quantizer = object()
    with pytest.raises(NotImplementedError, match="does not support quantized models"):
        Trainer(model=model, args=_args(tmp_path))


def test_model_distributed_by_transformers_is_refused(tmp_path):
    from bmtwrap.hf import Trainer

    model = _tiny_model()
    model._tp_size = 2  # as from_pretrained(tp_plan="auto") leaves it
    with pytest.raises(NotImplementedError, match="already distributed by transformers"):
        Trainer(model=model, args=_args(tmp_path))


def test_optimizer_outside_the_adamw_family_needs_a_choice(tmp_path):
    from bmtwrap.hf import Trainer

    with pytest.raises(ValueError, match=r"args.optim='adafactor': .*pass optimizer_cls_and_kwargs="):
        Trainer(model=_tiny_model(), args=_args(tmp_path, optim="adafactor"))


def test_offload_with_a_chosen_optimizer(tmp_path):
    from bmtwrap.hf import Trainer

    model = _tiny_model()
    with pytest.raises(ValueError, match="offload=True chooses the optimizer .* but optimizers= or"):
        Trainer(model=model, args=_args(tmp_path), optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
                offload=True)


def test_offload_takes_true_false_or_auto(tmp_path):
    from bmtwrap.hf import Trainer

    with pytest.raises(ValueError, match="offload must be True, False or 'auto', got 'cpu'"):
        Trainer(model=_tiny_model(), args=_args(tmp_path), offload="cpu")


def test_gradient_checkpointing_against_wrap_options(tmp_path):
    from bmtwrap.hf import Trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.23 renamed it activation_checkpointing
        args = _args(tmp_path, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="gradient_checkpointing=True asks for .* wrap_options has checkpoint=False"):
        Trainer(model=_tiny_model(), args=args, wrap_options={"checkpoint": False})


def test_wrap_options_must_be_a_dict(tmp_path):
    from bmtwrap.hf import Trainer

    with pytest.raises(TypeError, match="wrap_options must be a dict"):
        Trainer(model=_tiny_model(), args=_args(tmp_path), wrap_options=["checkpoint"])



def test_a_gpu_budget_reaches_wrap(tmp_path):
    from bmtwrap.hf import Trainer
    from bmtwrap.wrap.convert import wrapped_record

    trainer = Trainer(model=_tiny_model(), args=_args(tmp_path), wrap_options={"max_gpu_memory": "24GiB"})
    assert wrapped_record(trainer.model).options.max_gpu_memory == 24 * 2**30


def test_tensor_parallelism_is_refused(tmp_path):
    from bmtwrap.hf import Trainer

    with pytest.raises(NotImplementedError, match=r"wrap_options=\{'tp_size': 2\}: tensor parallelism needs the same "
                                                  "batch on every rank of a tensor-parallel group"):
        Trainer(model=_tiny_model(), args=_args(tmp_path), wrap_options={"tp_size": 2})


def test_wrap_options_are_wraps_arguments(tmp_path):
    from bmtwrap.hf import Trainer

    with pytest.raises(TypeError, match=r"wrap_options has \['checkpointing'\], which bmtwrap.wrap does not take"):
        Trainer(model=_tiny_model(), args=_args(tmp_path), wrap_options={"checkpointing": True})
