"""GPU tests: bf16 training on 2 GPUs over NCCL against the unwrapped model on one GPU.

Tolerances (bf16 keeps 8 significant bits): losses within 2% relative at every step; every
parameter within 4 bf16 steps (4 x 2^-7) of its tensor's largest magnitude. Averaging over
ranks rounds differently from one process, and a parameter near a rounding boundary of bf16
then lands one step away; a fault (a lost or doubled gradient) moves weights by far more over
10 steps of lr 1e-3 and also shows in the loss.
"""

import pytest
import torch

from launch import run_cases
from test_parity import TRAINING


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs (sharding over NCCL)")
def test_bf16_training_matches_unwrapped_on_two_gpus():
    results = run_cases("parity.py", 2, "cuda-bf16")
    failures = []
    for name in [n for n in TRAINING if "adam" not in n] + ["hidden_states", "eval_no_grad"]:
        r = results[name]
        if "error" in r:
            failures.append(f"{name}: {r['error']}")
        elif name in TRAINING and (r["loss_max_rel"] > 2e-2 or r["param_max_rel_scale"] > 4 * 2**-7):
            failures.append(f"{name}: loss {r['loss_max_rel']:.3g}, params {r['param_max_rel_scale']:.3g} "
                            f"({r['param_worst']})")
    for name in ("offload_matches_adam", "offload_in_backward_matches_adam", "offload_params_matches_adam",
                 "offload_params_in_backward_matches_adam", "offload_half_matches_adam", "offload_auto_matches_adam"):
        offload = results[name]
        if "error" in offload:
            failures.append(f"{name}: {offload['error']}")
        elif offload["master_max_rel"] > 1e-5 or offload["loss_max_rel"] > 1e-3 or offload["param_max_abs"] > 2**-7:
            # CPU and CUDA kernels round differently in fp32 (1e-7 per step); bf16 copies may then
            # land one step apart.
            failures.append(f"{name}: {offload}")
    for name in ("resume_offload_params_gpu", "resume_offload_half_gpu"):
        r = results[name]
        if "error" in r or not (r["losses_equal"] and r["params_equal"]):
            failures.append(f"{name}: state_dict -> load_state_dict does not resume bit-exactly: {r}")
    beside = results["gpu_updates_beside_forward"]
    if "error" in beside or not (beside["losses_equal"] and beside["params_differing"] == 0
                                 and beside["moments_equal"] and beside["offload_fraction"] == [0.0, 0.0]):
        failures.append(f"GPU updates on a side stream differ from those on the computing stream: {beside}")
    half = results["offload_half_matches_adam"].get("gpu_state_fraction", 0.0)
    if not 0.3 <= half <= 0.7:
        failures.append(f"offload_fraction=0.5 kept {half:.2f} of the state on the GPU")
    if results["offload_matches_adam"].get("gpu_state_fraction") != 0.0:
        failures.append("the full offload kept state on the GPU")
    print({name: {k: v for k, v in r.items() if k != "error"} for name, r in results.items()})
    assert not failures, "\n".join(failures)


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
def test_automatic_offload_fraction_on_one_gpu():
    """offload_fraction="auto" with step_in_backward: the state that fits (here all of it) is on the GPU, made
    there during the first backward and never on the host, and training is the fused optimizer's (CPU and
    CUDA kernels round differently in fp32: 1e-5 on masters)."""
    r = run_cases("parity.py", 1, "cuda-bf16", "offload_auto_matches_adam")["offload_auto_matches_adam"]
    assert "error" not in r, r.get("error")
    assert r["gpu_state_fraction"] == 1.0 and r["host_state_elements"] == 0, r
    assert r["master_max_rel"] <= 1e-5 and r["loss_max_rel"] <= 1e-3 and r["param_max_abs"] <= 2**-7, r


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
def test_gradients_wait_for_the_cpu_on_the_host():
    """step_in_backward on one GPU: the gradients handed to the CPU wait in page-locked host memory (none on
    the GPU), whose blocks later steps reuse (the pool never holds more than a step's gradients); training
    stays the fused optimizer's."""
    names = ["offload_grads_wait_on_host", "offload_in_backward_matches_adam"]
    results = run_cases("parity.py", 1, "cuda-bf16", ",".join(names))
    r = results["offload_grads_wait_on_host"]
    assert "error" not in r, r.get("error")
    assert r["held_grad_devices"] == ["cpu"], r
    # The host blocks are reused: four steps take no more than one step's gradients.
    assert 0 < r["pool_growth"][-1] <= r["step_grad_bytes"], r
    r = results["offload_in_backward_matches_adam"]
    assert "error" not in r, r.get("error")
    assert r["master_max_rel"] <= 1e-5 and r["loss_max_rel"] <= 1e-3 and r["param_max_abs"] <= 2**-7, r


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
def test_offloaded_parameters_on_one_gpu():
    """wrap(offload_params=True) on one GPU: training equals the fused optimizer's, resuming is exact, and the
    shards live in page-locked memory of their exact size that later steps reuse."""
    names = ["offload_params_matches_adam", "offload_params_in_backward_matches_adam", "resume_offload_params_gpu",
             "offload_params_pinned_exactly"]
    results = run_cases("parity.py", 1, "cuda-bf16", ",".join(names))
    for name in names[:2]:
        r = results[name]
        assert "error" not in r, r.get("error")
        assert r["master_max_rel"] <= 1e-5 and r["loss_max_rel"] <= 1e-3 and r["param_max_abs"] <= 2**-7, r
    r = results["resume_offload_params_gpu"]
    assert "error" not in r and r["losses_equal"] and r["params_equal"], r
    r = results["offload_params_pinned_exactly"]
    assert "error" not in r, r.get("error")
    assert r["offloaded_params"] > 0 and r["all_pinned"], r
    assert r["pool_bytes_after_build"] == r["shard_bytes"], r
    # The host gradients of a step reuse the blocks freed by the step before: the pool stops growing.
    registered = r["registered_after_step"]
    assert registered[-1] == registered[-2] == registered[-3], r


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs (sharding over NCCL)")
def test_hugging_face_cases_on_two_gpus():
    """The wrap() cases (fp32) over NCCL: generate() in step across ranks, with parameters on the GPU and
    offloaded to the host; meta models loaded or materialised; training with offloaded parameters.
    Tolerances as on the CPU, but 1e-4: GPU kernels sum in another order for another batch size."""
    results = run_cases("wrap_dist.py", 2, "cuda")
    failures = [f"{name}: {r['error']}" for name, r in results.items() if "error" in r]
    for name in ("generate", "generate_offloaded"):
        if "error" not in results[name] and not results[name]["all_equal"]:
            failures.append(f"{name}: generated tokens differ from the unwrapped model's")
    load, train = results["meta_then_load"], results["offload_params_training"]
    if "error" not in load and not (load["loss_rel"] <= 1e-4 and load["grad_rel"] <= 1e-4 and load["inv_freq_equal"]):
        failures.append(f"meta_then_load: {load}")
    if "error" not in train and not (train["block_params_on_cpu"] and train["root_params_on_device"]
                                     and train["loss_max_rel"] <= 1e-4
                                     and train["param_max_abs"] <= 1e-4):
        failures.append(f"offload_params_training: {train}")
    print({name: {k: v for k, v in r.items() if k != "error"} for name, r in results.items()})
    assert not failures, "\n".join(failures)


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
def test_hugging_face_import_on_one_gpu(tmp_path):
    """tests/test_hf_import.py's check on the GPU: bmt.from_pretrained of 16 families equals transformers' own
    from_pretrained on the same GPU, every parameter and buffer bit for bit, and so does the loss of a batch."""
    results = run_cases("hf_import.py", 1, str(tmp_path))
    failures = [f"{name}: {r}" for name, r in results.items()
                if "error" in r or r["buffers_unequal"] or r.get("params_unequal") or r.get("loss_rel", 0.0) != 0.0]
    assert len(results) == 32 and not failures, "\n".join(failures)


def _llama_steps(checkpoint, max_gpu_memory=None, steps=6, batch=4, optimizer="adam", report=None, **options):
    """A 0.5B Llama in bf16 trained ``steps`` steps on this GPU, in a process of its own
    (``dist_cases/llama_steps.py``); the most memory a step took (the allocator's reserve and the memory outside
    it, from step 2 on) and the blocks checkpoint="auto" kept. The optimizer is ``AdamOptimizer``, or with
    ``optimizer="auto"`` ``bmt.optim.auto_adam``'s choice (given ``options``); ``report`` (a dict) gets its class,
    offload fraction, whether wrap offloaded the parameters, the losses and the warnings."""
    import gc
    import json

    # The worker counts every process's memory on the card (the driver's figure), this one's too: the GPU tests that
    # ran here before leave blocks cached in this process's allocator, which would count against its budget.
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    spec = dict(checkpoint=checkpoint, max_gpu_memory=max_gpu_memory, steps=steps, batch=batch, optimizer=optimizer,
                options=options)
    result = run_cases("llama_steps.py", 1, json.dumps(spec))["steps"]
    assert "error" not in result, result.get("error")
    if report is not None:
        report.update({k: v for k, v in result.items() if k not in ("used", "kept")})
    return result["used"], result["kept"]


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
def test_auto_checkpoint_keeps_what_a_budget_allows_on_one_gpu():
    """checkpoint="auto" under max_gpu_memory: some blocks kept, not all, and no step above the budget; with the
    whole card every block of this small model is kept."""
    checkpointed, _ = _llama_steps(True)
    kept_all, _ = _llama_steps(False)
    # Past the 4 % margin, room for about half of the blocks' activations.
    budget = int((checkpointed + (kept_all - checkpointed) / 2) / 0.96)
    used, kept = _llama_steps("auto", max_gpu_memory=budget)
    assert 0 < kept < 8 and used <= budget, (kept, used / 2**30, budget / 2**30)
    _, kept = _llama_steps("auto")
    assert kept == 8


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
def test_a_budget_chooses_the_offload_on_one_gpu():
    """Under max_gpu_memory, auto_adam puts on the host the optimizer state that does not fit; a budget that the
    parameters and gradients (1.9 GiB here) would fill puts the blocks' parameters there too (with a warning). Every
    step from the second on stays under the budget, as nvidia-smi counts, and the loss falls."""
    roomy = {}
    used, _ = _llama_steps("auto", max_gpu_memory="7GiB", batch=1, optimizer="auto", report=roomy,
                           step_in_backward=True)
    assert roomy["optimizer"] == "AdamOffloadOptimizer" and not roomy["offload_params"], roomy
    assert 0.0 < roomy["offload_fraction"] < 1.0 and used <= 7 * 2**30, (roomy, used / 2**30)
    assert roomy["losses"][-1] < roomy["losses"][0], roomy["losses"]
    tight = {}
    used, _ = _llama_steps("auto", max_gpu_memory="3.5GiB", batch=1, optimizer="auto", report=tight)
    warning = "offload_params='auto': this LlamaForCausalLM's parameters and gradients take 1.9 GiB on each of 1"
    assert any(warning in w for w in tight["warnings"]), tight["warnings"]
    assert tight["offload_params"] and tight["optimizer"] == "AdamOffloadOptimizer", tight
    assert used <= 3.5 * 2**30, (tight, used / 2**30)
    assert tight["losses"][-1] < tight["losses"][0], tight["losses"]


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
@pytest.mark.parametrize("make", ["AdamOptimizer", "AdamOffloadOptimizer-gpu", "AdamOffloadOptimizer-half"])
def test_updates_launched_before_the_check_write_nothing_in_a_nonfinite_step(make, nonfinite, monkeypatch):
    """[Note: updates before the check]: the updates of the state on the GPU are launched before the host reads
    the non-finite check, gated on its flag. A non-finite step leaves every parameter, moment and step count as
    it was (bit for bit), and the training after it equals one that never had it."""
    import bmtwrap as bmt
    from bmtwrap import ops

    gated = []
    for name in ("adam_step_cuda", "adam_step_split"):
        def spy(*args, _kernel=getattr(ops, name), **kwargs):
            gated.append(kwargs.get("skip_if") is not None)
            return _kernel(*args, **kwargs)
        monkeypatch.setattr(ops, name, spy)

    def build():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device="cuda", dtype=dtype))
                  for n, dtype in ((4099, torch.bfloat16), (37, torch.bfloat16), (300, torch.float32))]
        kind, _, fraction = make.partition("-")
        options = {} if kind == "AdamOptimizer" else {"offload_fraction": 0.0 if fraction == "gpu" else 0.5}
        return params, getattr(bmt.optim, kind)(params, lr=1e-2, weight_decay=0.1, nonfinite=nonfinite, **options)

    def step(params, optimizer, seed, bad=False):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=generator, device="cuda", dtype=p.dtype)
            if bad and i == 1:
                p.grad[3] = float("nan")
        if bad and nonfinite == "raise":
            with pytest.raises(bmt.optim.NonFiniteGradientError, match="inf or NaN"):
                optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad()
        if hasattr(optimizer, "wait"):
            optimizer.wait()

    def snapshot(params, optimizer):
        optimizer.state_dict()  # waits for every update
        state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()} for p in params]
        return [p.detach().clone() for p in params], state

    def equal(a, b):
        (params_a, state_a), (params_b, state_b) = a, b
        return (all(torch.equal(x, y) for x, y in zip(params_a, params_b))
                and all(sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k])
                                                       else sa[k] == sb[k] for k in sa)
                        for sa, sb in zip(state_a, state_b)))

    params, optimizer = build()
    step(params, optimizer, 1)
    after_first = snapshot(params, optimizer)
    gated.clear()
    step(params, optimizer, 2, bad=True)
    assert any(gated), "no update was launched before the check"
    assert equal(snapshot(params, optimizer), after_first), "the non-finite step wrote"
    assert optimizer.skipped_steps == (nonfinite == "skip")
    step(params, optimizer, 3)
    reference_params, reference = build()
    step(reference_params, reference, 1)
    step(reference_params, reference, 3)
    assert equal(snapshot(params, optimizer), snapshot(reference_params, reference))
