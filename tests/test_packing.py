"""bmtwrap.data.packing: the packer's rows, positions, labels and padding shares; packed batches against
every document run alone (per-token losses and gradients), on the plain model of each supported family
and on the model wrapped by bmtwrap at world size 2; the refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from bmtwrap.data import Packer, PaddingShare, check_packing, first_fit_decreasing, packed_inputs
from launch import run_cases
from packing_ref import alone, documents, examples, loss_count, tiny, token_loss_gap, token_losses

SEQ = 48


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and on a shared, busy machine its waits cost seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pack(stream, **options):
    packer = Packer(seq=SEQ, **{"rows": 3, "seed": 0, "buffer_size": 16, **options})
    return packer, list(packer.batches(stream))


def test_first_fit_decreasing_fills_rows_and_places_each_length_once():
    lengths = [7, 3, 9, 1, 5, 5, 2, 8, 4, 6]
    rows = first_fit_decreasing(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 5  # 50 tokens in rows of 10: as few rows as can be
    assert first_fit_decreasing([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]


def test_rows_hold_every_document_once_with_restarting_positions_and_its_own_labels():
    stream = examples(60, seed=3, longest=30)
    _, batches = _pack(stream)
    seen = []
    for batch in batches:
        assert batch.input_ids.shape[1] == SEQ and batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape
        docs = documents(batch.position_ids)
        for doc in docs:
            ids = batch.input_ids[doc.row, doc.start : doc.end].tolist()
            labels = batch.labels[doc.row, doc.start : doc.end].tolist()
            assert batch.position_ids[doc.row, doc.start : doc.end].tolist() == list(range(doc.end - doc.start))
            assert labels[0] == -100, "a document's first label must not be trained on (the previous token predicts it)"
            if set(ids) == {0}:  # padding: the row's last stretch
                assert doc.end == SEQ and set(labels) == {-100}
                continue
            seen.append((ids, labels[1:]))
        assert batch.documents == sum(1 for d in docs if set(batch.input_ids[d.row, d.start : d.end].tolist()) != {0})
        assert batch.tokens == int((batch.input_ids != 0).sum())
    expected = sorted((e["input_ids"], e["labels"][1:]) for e in stream)
    assert sorted(seen) == expected, "each example must appear exactly once, whole"
    assert all(b.input_ids.shape[0] == 3 for b in batches[:-1])


def test_the_same_seed_gives_the_same_batches_and_another_seed_others():
    stream = examples(40, seed=4, longest=30)
    first, again, other = (_pack(stream, seed=s)[1] for s in (0, 0, 1))
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(first, again)) and len(first) == len(again)
    assert any(not torch.equal(a.input_ids, b.input_ids) for a, b in zip(first, other))


def test_padding_shares_count_the_packed_rows_and_the_padded_unpacked_batches():
    stream = examples(50, seed=5, longest=30)
    packer, batches = _pack(stream)
    tokens = sum(len(e["input_ids"]) for e in stream)
    cells = sum(b.input_ids.numel() for b in batches)
    # Unpacked: in the stream's order, as many a batch as fit 3 x SEQ tokens padded to their longest.
    groups, group = [], []
    for e in stream:
        if (len(group) + 1) * max(len(x) for x in group + [e["input_ids"]]) > 3 * SEQ:
            groups.append(group)
            group = []
        group.append(e["input_ids"])
    groups.append(group)
    assert sum(map(len, groups)) == len(stream) and len(groups) > 2
    unpacked_cells = sum(len(g) * max(map(len, g)) for g in groups)
    share = packer.padding_share()
    assert isinstance(share, PaddingShare)
    assert share.packed == pytest.approx(1 - tokens / cells) and share.unpacked == pytest.approx(1 - tokens / unpacked_cells)
    assert share.packed < share.unpacked


@pytest.mark.parametrize("bad, message", [
    ({"input_ids": [1, 2]}, "expected a mapping with 'input_ids' and 'labels'"),
    ({"input_ids": [1, 2], "labels": [1]}, "2 input_ids but 1 labels"),
    ({"input_ids": list(range(SEQ + 1)), "labels": list(range(SEQ + 1))}, f"49 tokens, expected 1 to seq={SEQ}; truncate"),
    ({"input_ids": [], "labels": []}, "0 tokens"),
])
def test_bad_examples_are_named_with_their_position(bad, message):
    with pytest.raises(ValueError, match=r"example 2: .*" + message.replace("(", r"\(").replace("[", r"\[")):
        _pack(examples(2, seed=0, longest=5) + [bad])
    with pytest.raises(ValueError, match="rows must be an integer of at least 1, got 0"):
        Packer(seq=SEQ, rows=0)
    with pytest.raises(ValueError, match="nothing was packed yet"):
        Packer(seq=SEQ, rows=1).padding_share()


def _one_batch(rows: int = 3):
    return _pack(examples(30, seed=6, longest=30), rows=rows)[1][0]


@pytest.mark.parametrize("family, attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"),
                                          ("mistral", "sdpa"), ("qwen3", "sdpa"), ("gpt2", "sdpa"), ("gpt2", "eager")])
def test_packed_batch_equals_its_documents_alone_on_the_plain_model(family, attn):
    ref = tiny(family, attn)
    model = copy.deepcopy(ref)
    batch = _one_batch()
    assert token_loss_gap(model, ref, batch) <= 2e-6  # training mode, use_cache from model_inputs
    total, _ = alone(ref, batch, range(batch.input_ids.shape[0]))
    (total / loss_count(batch)).backward()
    loss = model(**batch.model_inputs(model)).loss
    loss.backward()
    assert abs(loss.item() - (total / loss_count(batch)).item()) <= 1e-6 * loss.item()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert (p.grad - q.grad).abs().max() <= 2e-6 * p.grad.abs().max(), name


def test_refused_family_would_attend_across_documents():
    """OPT takes its positions from the attention mask, not position_ids: packed, its documents see each other."""
    opt = tiny("opt")
    with pytest.raises(NotImplementedError, match=r"model type 'opt' \(OPTForCausalLM\).*checked only for gpt2, llama, "
                                                  r"mistral, qwen2, qwen3.*unpacked batches"):
        check_packing(opt)
    batch = _one_batch()
    with torch.no_grad():
        logits = opt(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    _, each = alone(opt, batch, range(3))
    packed = token_losses(logits, batch.labels)
    assert max((packed[d.row, d.start : d.end - 1] - losses).abs().max().item() for d, losses in each if len(losses)) > 1e-3


def test_other_refusals_name_the_fix():
    with pytest.raises(NotImplementedError, match="Sequential is not one. Pass one document per row"):
        _one_batch().model_inputs(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(NotImplementedError, match="attn_implementation='flex_attention'.*attn_implementation='sdpa'"):
        check_packing(tiny("llama", "flex_attention"))


def test_flash_attention_gets_the_rows_joined_into_one():
    """Flash attention's varlen path finds documents only in a batch of one row (not run here: no GPU)."""
    model = tiny("llama")
    model.config._attn_implementation = "flash_attention_2"
    batch = _one_batch()
    inputs = batch.model_inputs(model)
    assert inputs["use_cache"] is False and "attention_mask" not in inputs
    assert torch.equal(inputs["position_ids"], batch.position_ids.reshape(1, -1))
    assert torch.equal(inputs["labels"][0, ::SEQ], torch.full((3,), -100))  # no row predicts the next one's first token
    # Rows packed by other code (the main job's) get the same: packed_inputs is what model_inputs returns.
    for implementation in ("flash_attention_2", "sdpa"):
        model.config._attn_implementation = implementation
        mine = packed_inputs(model, input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids)
        theirs = batch.model_inputs(model)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine if k != "use_cache")
        rows = 1 if implementation == "flash_attention_2" else batch.input_ids.shape[0]
        assert mine["position_ids"].shape[0] == rows
    with pytest.raises(TypeError, match="packed_inputs needs position_ids"):
        packed_inputs(model, input_ids=batch.input_ids, labels=batch.labels)


@pytest.fixture(scope="module")
def wrapped():
    return run_cases("packing.py", 2)


@pytest.mark.parametrize("case", ["llama", "llama_checkpointed", "qwen2_checkpointed", "gpt2_checkpointed",
                                  "llama_compiled"])
def test_packed_batch_on_the_wrapped_model_equals_its_documents_alone(wrapped, case):
    r = wrapped[case]
    assert "error" not in r, r.get("error")
    assert r["token_loss_gap"] <= 2e-6 and r["loss_rel"] <= 1e-6 and r["grad_rel"] <= 2e-6, r
    assert r["control_gap"] > 1e-3, f"positions 0..seq-1 should have changed the losses: {r}"
    assert r["compiled_blocks"] == (2 if case.endswith("compiled") else 0), r


def test_packed_batch_through_a_peft_model_equals_its_documents_alone():
    import peft

    ref = tiny("llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(ref, config)
    assert token_loss_gap(model, model, _one_batch()) <= 2e-6
