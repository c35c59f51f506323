"""checkpoint="auto" decides from measured memory, under a budget, and recovers from running out of it.

The decision runs on the CPU with ``fake_gauge.FakeGauge`` in place of a GPU's counters. The
recovery runs tests/dist_cases/out_of_memory.py at world sizes 2 and 3: an out-of-memory error in
one kept block on one rank, in the first step that keeps activations, must leave the run with the
losses and parameters of a run without it. (An out-of-memory error nothing can recover from, and
the other ranks stopping at once, are in test_faults.py.)
"""

import importlib

import pytest
import torch

import bmtwrap as bmt
from bmtwrap.engine.memory import format_bytes, parse_bytes
from fake_gauge import GIB, FakeGauge
from launch import run_cases
from test_wrap import tiny_llama

auto = importlib.import_module("bmtwrap.wrap.auto")


@pytest.mark.parametrize("text, nbytes", [("24GiB", 24 * GIB), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20),
                                          ("1.5gib", int(1.5 * GIB)), (4096, 4096), ("100", 100)])
def test_sizes_parse(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("bad", ["24 gigs", "GiB", "-1GiB", 0, "", True, [24]])
def test_bad_sizes_are_refused_with_the_units(bad):
    with pytest.raises(ValueError, match="max_gpu_memory must be a (positive size|size such as '24GiB')"):
        parse_bytes(bad)


def test_sizes_format():
    assert format_bytes(24 * GIB) == "24.0 GiB" and format_bytes(512 * 2**20) == "512 MiB"


def _train(monkeypatch, gauge, steps=3, optimizer=None, **options):
    monkeypatch.setattr(auto, "gauge_for", lambda device: gauge)
    model = bmt.wrap(tiny_llama(num_hidden_layers=4), checkpoint="auto", **options)
    record = bmt.engine.schedule.engine().wrapped_record(model)
    optimizer = (optimizer or (lambda params: torch.optim.SGD(params, lr=1e-3)))(model.parameters())
    ids = torch.randint(0, 64, (2, 8))
    kept = []
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        kept.append([not runner.recompute for _, runner in record.runners])
    return kept, record.auto.report


def test_the_decision_waits_for_the_optimizers_first_step(monkeypatch):
    """With gradient accumulation the optimizer's state appears only at its first step: decide after it."""
    monkeypatch.setattr(auto, "gauge_for", lambda device: FakeGauge())
    model = bmt.wrap(tiny_llama(num_hidden_layers=4), checkpoint="auto")
    record = bmt.engine.schedule.engine().wrapped_record(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    for _ in range(3):  # three micro-batches of one step
        model(ids, labels=ids).loss.backward()
    assert not record.auto.decided and all(runner.recompute for _, runner in record.runners)
    optimizer.step()
    model(ids, labels=ids).loss.backward()
    assert record.auto.decided and record.auto.report["kept_blocks"] > 0


def test_auto_keeps_the_blocks_that_fit_the_measured_step(monkeypatch):
    kept, report = _train(monkeypatch, FakeGauge())
    # Step 1 measures (all checkpointed); step 2 keeps the first two blocks: 21 GiB predicted, 1 GiB each, 23.04 limit.
    assert kept == [[False] * 4, [True, True, False, False], [True, True, False, False]]
    assert report["predicted_peak_bytes"] == 21 * GIB and report["kept_blocks"] == 2
    assert report["limit_bytes"] == 24 * GIB - int(0.04 * 24 * GIB)


def test_memory_outside_the_allocator_and_a_budget_count(monkeypatch):
    kept, report = _train(monkeypatch, FakeGauge(outside=1))  # NCCL's buffers, the CUDA context: one block less
    assert kept[-1] == [True, False, False, False] and report["outside_allocator_bytes"] == GIB
    kept, report = _train(monkeypatch, FakeGauge(card=80), max_gpu_memory="22GiB")  # a budget below the card
    assert kept[-1] == [False] * 4 and report["limit_bytes"] == 22 * GIB - int(0.04 * 22 * GIB)
    kept, _ = _train(monkeypatch, FakeGauge(card=80), max_gpu_memory=26 * GIB)  # 26 - 1.04 - 21: 3 blocks fit
    assert kept[-1] == [True, True, True, False]
    kept, _ = _train(monkeypatch, FakeGauge(), max_gpu_memory="100GiB")  # no more than the card
    assert kept[-1] == [True, True, False, False]


def test_a_step_near_the_limit_gives_memory_back(monkeypatch):
    gauge = FakeGauge()
    monkeypatch.setattr(auto, "gauge_for", lambda device: gauge)
    model = bmt.wrap(tiny_llama(num_hidden_layers=4), checkpoint="auto")
    record = bmt.engine.schedule.engine().wrapped_record(model)
    ids = torch.randint(0, 64, (2, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # measured: 12 GiB at its peak
    gauge.top = 24 * GIB  # the next step, two blocks kept, peaks at the card: 0.48 GiB past the limit and half the margin
    step()
    assert [not r.recompute for _, r in record.runners] == [True, True, False, False]
    with pytest.warns(RuntimeWarning, match=r"came within 492 MiB of a GPU's limit \(24.0 GiB\); checkpoint='auto' "
                                            r"recomputes 1.0 GiB of activations more"):
        step()
    assert [not r.recompute for _, r in record.runners] == [True, False, False, False]


@pytest.mark.parametrize("world", [2, 3])
def test_a_kept_block_out_of_memory_recovers_on_every_rank(world, tmp_path):
    result = run_cases("out_of_memory.py", world)["recovers"]
    assert "error" not in result, result.get("error")
    assert result["report"]["kept_blocks"] == 2, result["report"]
    assert result["injected_losses"] == result["plain_losses"], "the recovered step computed something else"
    assert result["param_max_abs"] == 0.0, "the parameters differ from those of the run without the error"
    for rank, seen in enumerate(result["ranks"]):
        assert seen["plain_kept"][1:] == [[True, True, False, False]] * 4
        if rank == 1:  # the victim: its block 1 and the kept blocks after it recompute, and it says so once
            assert seen["fired"] and seen["warnings"] == [
                "bmtwrap: block 'layers.1' ran out of GPU memory in its forward on rank 1; checkpoint='auto' now "
                "recomputes it, and runs it again"]
        else:
            assert seen["warnings"] == []
        # In the step it failed the victim alone recomputes block 1; from the next step every rank agrees.
        assert seen["kept"][1] == ([True, False, False, False] if rank == 1 else [True, True, False, False])
        assert seen["kept"][2:] == [[True, False, False, False]] * 3


def test_a_budget_below_the_checkpointed_step_is_named(monkeypatch):
    with pytest.warns(RuntimeWarning, match=r"predicted to take 21.0 GiB of this GPU, above max_gpu_memory=20.0 GiB "
                                            r"less its margin \(19.2 GiB\); to stay under it, keep the optimizer's "
                                            r"state where it fits \(bmtwrap.optim.auto_adam\), offload the blocks' "
                                            r"parameters \(wrap\(model, offload_params=True\)\), or lower"):
        kept, _ = _train(monkeypatch, FakeGauge(card=80), max_gpu_memory="20GiB")
    assert kept[-1] == [False] * 4


def test_the_warning_reads_only_this_models_optimizers(monkeypatch):
    """Another model's offloading optimizer, still alive, changes nothing in what the warning advises."""
    other = bmt.wrap(tiny_llama(num_hidden_layers=2))
    alive = bmt.optim.AdamOffloadOptimizer(other.parameters(), lr=1e-3)
    alive.offload_fraction = 0.5  # as one that split its state with a GPU ("auto") would say
    with pytest.warns(RuntimeWarning, match=r"to stay under it, keep the optimizer's state where it fits "
                                            r"\(bmtwrap.optim.auto_adam\)"):
        _train(monkeypatch, FakeGauge(card=80), max_gpu_memory="20GiB")
    assert alive in bmt.engine.schedule.engine().offload_optimizers()


def test_the_warning_names_only_what_is_not_offloaded_yet(monkeypatch):
    """With the optimizer's state all on the host already, the warning does not advise moving it there."""
    with pytest.warns(RuntimeWarning, match=r"to stay under it, offload the blocks' parameters \(wrap\(model, "
                                            r"offload_params=True\)\), or lower the per-GPU batch"):
        _train(monkeypatch, FakeGauge(card=80), max_gpu_memory="20GiB",
               optimizer=lambda params: bmt.optim.AdamOffloadOptimizer(params, lr=1e-3, offload_fraction=1.0))
