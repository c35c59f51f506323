"""bmtwrap.hf's SFTTrainer and DPOTrainer: TRL's trainers on a sharded model, against TRL on the unwrapped one.

``tests/dist_cases/trl_trainers.py`` runs each scenario twice: with bmtwrap's trainer at world size 2 over
gloo (each rank half of every global batch), and with TRL's own trainer in one separate process on the whole
batch (no torchrun variables, no bmtwrap). fp32 on the CPU, 4 optimizer steps at learning rate 1e-3. SFT padded
and padding-free; DPO against a reference model (sharded too), against reference log-probabilities computed
before training, and with LoRA against the model with its adapters disabled or with TRL's frozen copy of a
trained adapter.

Tolerances. The logged losses and gradient norms are sums of the same fp32 terms in another order (each rank
half the batch, then over ranks): within 1e-5 relative, as in tests/test_trainer.py (measured: 2e-7). The final
parameters: within 1e-5 elementwise, 1% of the learning rate, which is about the size of an Adam step of any weight
in these first steps, whatever its gradient: gradients that differ by rounding move the weights by far less
(measured: 2e-7), while a lost micro-batch, a rank's own gradient norm or a reference model that is not the initial
one moves them by a sizeable part of a step. The one exception, a weight whose gradient is itself within rounding
of zero (Adam may then step it either way), is absent here as measured; tests/test_trainer.py bounds the same
engine's gradients and AdamW updates from the rounding itself, that case included. What this file adds is TRL's
losses (its fused LM head, DPO's reference pass) on a sharded model. Resuming is compared with the uninterrupted
run and is exact.
"""

from __future__ import annotations

import ast
import re

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

import transformers as T  # noqa: E402

from launch import ROOT, run_cases, run_reference  # noqa: E402

SCENARIOS = ["sft", "sft_padding_free", "dpo", "dpo_precomputed", "dpo_lora", "dpo_lora_ref_adapter",
             "dpo_from_folder"]
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5  # 1% of the learning rate (see the module docstring)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("trl")
    ours = run_cases("trl_trainers.py", 2, str(work))  # first: the reference loads the folder it saves
    return work, ours, run_reference("trl_trainers.py", work)


def _case(runs, name):
    result = runs[1][name]
    assert "error" not in result, result.get("error")
    return result


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("name", SCENARIOS)
def test_same_losses_and_parameters_as_trl_in_one_process(runs, name):
    work, _, reference = runs
    ours, theirs = _case(runs, name), reference[name]
    assert [x[0] for x in ours["losses"]] == [x[0] for x in theirs["losses"]] == [1, 2, 3, 4], "other steps logged"
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(ours["losses"], theirs["losses"]):
        assert _rel(loss, ref_loss) <= LOSS_RTOL, f"step {step}: loss {loss} vs TRL's {ref_loss}"
        assert _rel(norm, ref_norm) <= LOSS_RTOL, f"step {step}: grad_norm {norm} vs TRL's {ref_norm}"
    mine, ref = torch.load(work / f"{name}.bmt.pt"), torch.load(work / f"{name}.ref.pt")
    assert sorted(mine) == sorted(ref)
    worst = max(ref, key=lambda k: (mine[k] - ref[k]).abs().max().item())
    gap = (mine[worst] - ref[worst]).abs().max().item()
    assert gap <= PARAM_ATOL, f"{worst}: final parameters {gap:.3g} apart"


@pytest.mark.parametrize("name", SCENARIOS)
def test_model_is_sharded_with_bmtwraps_checkpointing(runs, name):
    r = _case(runs, name)
    assert r["sharded"], "the trained model is not wrapped by bmtwrap"
    assert not r["hf_checkpointing"], "TRL's gradient_checkpointing=True turned Hugging Face's on inside the blocks"
    # TRL's default gradient_checkpointing=True: SFT keeps the blocks that fit, DPO (a second model) recomputes all.
    assert r["checkpoint"] == ("auto" if name.startswith("sft") else True), r["checkpoint"]


def test_dpo_reference_model_is_sharded_frozen_in_eval_mode(runs):
    for name in ("dpo", "dpo_from_folder"):  # the reference model given, or loaded by TRL from the model's folder
        r = _case(runs, name)
        assert r["ref_sharded"] and r["ref_frozen"] and r["ref_eval"], (name, r)
    # The reference is the model: adapters disabled, its "ref" adapter active, or before training.
    for name in ("dpo_lora", "dpo_lora_ref_adapter", "dpo_precomputed"):
        assert not _case(runs, name)["ref_sharded"], f"{name}: TRL loaded a reference model"


def test_reference_model_bmtwrap_cannot_shard_is_refused(runs):
    assert re.fullmatch(r"bmtwrap.hf.DPOTrainer \(its reference model\) does not support quantized models .*"
                        r"load the model in bf16 or fp32", _case(runs, "quantized_reference")["error_text"])


def test_sft_resume_from_checkpoint_is_exact(runs):
    r = _case(runs, "resume")
    assert r["class"] == "SFTTrainer" and r["sharded"], "bmtwrap.hf.sharded(trl.SFTTrainer) did not shard"
    resumed = [x for x in r["resumed"] if x[0] > 2]
    assert [x[0] for x in resumed] == [x[0] for x in r["straight"]] == [3, 4]
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(resumed, r["straight"]):
        assert _rel(loss, ref_loss) <= 1e-6 and _rel(norm, ref_norm) <= 1e-6, (step, loss, ref_loss)
    assert r["param_max_abs"] <= 1e-6, r["param_max_abs"]


def test_save_model_loads_in_plain_transformers(runs):
    assert "model.safetensors" in _case(runs, "save_model")["files"]
    assert runs[2]["loaded"] == {"keys_equal": True, "weights_equal": True}


# --- in one process: what is refused before anything is built ------------------------------------------------


def _tiny() -> T.LlamaForCausalLM:
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))


@pytest.mark.parametrize("trainer", ["SFTTrainer", "DPOTrainer"])
def test_activation_offloading_is_refused(trainer, tmp_path):
    import bmtwrap.hf
    import trl

    config = {"SFTTrainer": trl.SFTConfig, "DPOTrainer": trl.DPOConfig}[trainer]
    args = config(str(tmp_path), activation_offloading=True, use_cpu=True, report_to=[], bf16=False)
    with pytest.raises(NotImplementedError, match=rf"bmtwrap.hf.{trainer} does not support activation_offloading=True"
                                                  r": .*leave gradient_checkpointing=True"):
        getattr(bmtwrap.hf, trainer)(model=_tiny(), args=args, train_dataset=None)


def test_selective_checkpointing_is_refused(tmp_path):
    import trl
    from bmtwrap.hf import SFTTrainer

    args = trl.SFTConfig(str(tmp_path), gradient_checkpointing_kwargs={"selective": True}, use_cpu=True,
                         report_to=[], bf16=False)
    with pytest.raises(NotImplementedError, match=r"gradient_checkpointing_kwargs=\{'selective': True\}.*drop"):
        SFTTrainer(_tiny(), args, train_dataset=None)


def test_sharded_refuses_what_is_not_a_trainer_and_checks_trl_options(tmp_path):
    import trl
    from bmtwrap.hf import sharded

    with pytest.raises(TypeError, match="sharded\\(\\) takes a subclass of transformers.Trainer, got <class 'int'>"):
        sharded(int)
    args = trl.SFTConfig(str(tmp_path), activation_offloading=True, use_cpu=True, report_to=[], bf16=False)
    with pytest.raises(NotImplementedError, match=r"bmtwrap.hf.sharded\(SFTTrainer\) does not support "
                                                  r"activation_offloading=True"):
        sharded(trl.SFTTrainer)(_tiny(), args, train_dataset=None)


def test_mixin_listed_first_is_refused(tmp_path):
    import trl
    from bmtwrap.hf import ShardedTrainerMixin

    class Wrong(ShardedTrainerMixin, trl.SFTTrainer):
        pass

    with pytest.raises(TypeError, match=r"Wrong lists ShardedTrainerMixin before SFTTrainer: .*"
                                        r"class Wrong\(SFTTrainer, ShardedTrainerMixin\)"):
        Wrong(model=_tiny(), args=trl.SFTConfig(str(tmp_path), use_cpu=True, report_to=[]), train_dataset=None)


def test_bmtwrap_hf_imports_trl_only_when_used():
    """``import bmtwrap.hf`` needs no trl: no module-level import of it (read with ast, nothing imported)."""
    tree = ast.parse((ROOT / "bmtwrap" / "hf.py").read_text())
    top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = [alias.name for node in top for alias in node.names] + [node.module or "" for node in top
                                                                    if isinstance(node, ast.ImportFrom)]
    assert not any(name == "trl" or name.startswith("trl.") or name == "hf_trl" for name in names), names
    import bmtwrap.hf
    import bmtwrap.hf_trl

    assert bmtwrap.hf.SFTTrainer is bmtwrap.hf_trl.SFTTrainer and bmtwrap.hf.DPOTrainer is bmtwrap.hf_trl.DPOTrainer
