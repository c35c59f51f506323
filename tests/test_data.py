"""bmtwrap.data in one process: every file format read alike, conversations rendered exactly as the tokenizer's
own apply_chat_template renders them, labels on the completion or the assistant's turns only, and the model's
loss on a padded batch equal to a masked cross-entropy computed by hand (fp32, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from bmtwrap.data import (IGNORE_INDEX, SIMPLE_CHAT_TEMPLATE, DataError, Fields, MissingFields, Shape, TrainOn,
                          find_shape, pad_examples, read_records, render_chat, tokenize_record, tokenize_records)
from launch import ROOT

CHAT = ROOT / "examples" / "data" / "chat.jsonl"
PAIRS = [{"prompt": f"What is {a} plus {b}?", "completion": f" {a + b}."} for a, b in [(1, 2), (3, 4), (5, 6)]]
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """A byte-level BPE trained on the bundled conversations (as the example's default), with the simple template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [m["content"] for line in CHAT.read_text().splitlines() for m in json.loads(line)["messages"]]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS)
    fast.chat_template = SIMPLE_CHAT_TEMPLATE
    return fast


def conversations() -> List[List[Dict[str, str]]]:
    return [json.loads(line)["messages"] for line in CHAT.read_text().splitlines()]


# --- reading ----------------------------------------------------------------------------------------------


def write(folder: Path, kind: str) -> Path:
    """PAIRS written as ``kind``; the path to give read_records."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    records = datasets.Dataset.from_list(PAIRS)
    if kind == "jsonl":
        (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
        return folder / "pairs.jsonl"
    if kind == "json":
        (folder / "pairs.json").write_text(json.dumps(PAIRS, indent=1))
        return folder / "pairs.json"
    if kind == "parquet":
        records.to_parquet(str(folder / "pairs.parquet"))
        return folder / "pairs.parquet"
    if kind == "csv":
        records.to_csv(str(folder / "pairs.csv"), index=False)
        return folder / "pairs.csv"
    if kind == "folder":  # two files, read in name order
        (folder / "data" / "part").mkdir(parents=True)
        (folder / "data" / "a.jsonl").write_text(json.dumps(PAIRS[0]) + "\n")
        (folder / "data" / "part" / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS[1:]))
        return folder / "data"
    if kind == "save_to_disk":
        records.save_to_disk(str(folder / "saved"))
        return folder / "saved"
    assert kind == "dataset_dict"
    datasets.DatasetDict({"train": records, "test": records.select([0])}).save_to_disk(str(folder / "dict"))
    return folder / "dict"


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "folder", "save_to_disk", "dataset_dict"])
def test_every_format_reads_the_same_records(tmp_path: Path, kind: str) -> None:
    records = read_records(write(tmp_path, kind))
    assert records.to_list() == PAIRS
    assert find_shape(records.column_names) is Shape.PROMPT_COMPLETION


def test_the_bundled_conversations_read_as_messages() -> None:
    records = read_records(CHAT)
    assert find_shape(records.column_names) is Shape.MESSAGES
    assert records["messages"] == conversations()


def test_fields_name_other_columns(tokenizer: Any) -> None:
    fields = Fields.parse("prompt=question, completion=answer")
    assert find_shape(["question", "answer", "id"], fields) is Shape.PROMPT_COMPLETION
    renamed = {"question": PAIRS[0]["prompt"], "answer": PAIRS[0]["completion"]}
    assert tokenize_record(renamed, tokenizer, Shape.PROMPT_COMPLETION, max_length=64, fields=fields) == \
        tokenize_record(PAIRS[0], tokenizer, Shape.PROMPT_COMPLETION, max_length=64)
    with pytest.raises(ValueError, match="no field 'answer'; the fields are text, prompt, completion, messages"):
        Fields.parse("answer=completion")
    with pytest.raises(ValueError, match="is not FIELD=COLUMN"):
        Fields.parse("prompt")


# --- rendering and labels ---------------------------------------------------------------------------------


def learnt_text(tokenizer: Any, example: Dict[str, List[int]]) -> str:
    return tokenizer.decode([t for t in example["labels"] if t != IGNORE_INDEX])


def test_conversations_render_as_apply_chat_template(tokenizer: Any) -> None:
    for messages in conversations():
        ids, assistant = render_chat(tokenizer, messages)
        assert ids == list(tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"])
        # The assistant's tokens are its turns and the end-of-text that closes each, nothing else.
        wanted = "".join(m["content"] + EOS for m in messages if m["role"] == "assistant")
        assert tokenizer.decode([t for t, a in zip(ids, assistant) if a]) == wanted


def test_generation_marks_give_the_same_tokens(tokenizer: Any) -> None:
    # A template marking the assistant's turns with {% generation %}: transformers reads the marks.
    marked = SIMPLE_CHAT_TEMPLATE.replace(
        "{{- '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ eos_token }}",
        "{{- '<|' ~ message['role'] ~ '|>\\n' }}{%- if message['role'] == 'assistant' %}{% generation %}"
        "{{- message['content'] ~ eos_token }}{% endgeneration %}{%- else %}{{- message['content'] ~ eos_token }}"
        "{%- endif %}")
    assert marked != SIMPLE_CHAT_TEMPLATE
    copy = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer, eos_token=EOS, bos_token=EOS)
    copy.chat_template = marked
    for messages in conversations()[:10]:
        assert render_chat(copy, messages) == render_chat(tokenizer, messages)


def test_labels_of_each_shape(tokenizer: Any) -> None:
    pair = tokenize_record(PAIRS[0], tokenizer, Shape.PROMPT_COMPLETION, max_length=64)
    assert learnt_text(tokenizer, pair) == PAIRS[0]["completion"] + EOS
    assert tokenizer.decode(pair["input_ids"]) == PAIRS[0]["prompt"] + PAIRS[0]["completion"] + EOS
    # A token across the boundary (the prompt's last space and the completion's first word) is learnt.
    straddling = tokenize_record({"prompt": "What is 1 plus 2? ", "completion": "3."}, tokenizer,
                                 Shape.PROMPT_COMPLETION, max_length=64)
    assert learnt_text(tokenizer, straddling) == " 3." + EOS
    everything = tokenize_record(PAIRS[0], tokenizer, Shape.PROMPT_COMPLETION, max_length=64, train_on=TrainOn.ALL)
    assert everything["labels"] == everything["input_ids"] == pair["input_ids"]
    text = tokenize_record({"text": "Hello there."}, tokenizer, Shape.TEXT, max_length=64)
    assert text["labels"] == text["input_ids"] and tokenizer.decode(text["input_ids"]) == "Hello there." + EOS


def test_cut_and_dropped_examples_are_counted(tokenizer: Any) -> None:
    import datasets

    prompt_lengths = [len(tokenizer(p["prompt"])["input_ids"]) for p in PAIRS]
    long_prompt = {"prompt": "one two three four five six seven eight nine ten " * 3, "completion": "done"}
    records = datasets.Dataset.from_list([PAIRS[0], long_prompt, PAIRS[1]])
    cut = max(prompt_lengths) + 3
    examples, report = tokenize_records(records, tokenizer, Shape.PROMPT_COMPLETION, max_length=cut)
    assert (report.examples, report.kept, report.cut, report.dropped, report.first_dropped) == (3, 2, 1, 1, 1)
    assert report.longest == len(tokenize_record(long_prompt, tokenizer, Shape.PROMPT_COMPLETION,
                                                 max_length=1000)["input_ids"])
    assert examples.column_names == ["input_ids", "labels"] and all(len(e) <= cut for e in examples["input_ids"])


# --- the loss ---------------------------------------------------------------------------------------------


def test_padded_batch_loss_is_the_masked_cross_entropy(tokenizer: Any) -> None:
    import transformers

    examples = [tokenize_record({"messages": m}, tokenizer, Shape.MESSAGES, max_length=48) for m in conversations()[:4]]
    batch = pad_examples(examples, pad_id=tokenizer.eos_token_id)
    widths = [len(e["input_ids"]) for e in examples]
    assert batch.input_ids.shape == (4, max(widths)) and batch.padding == 4 * max(widths) - sum(widths) > 0
    assert (batch.labels[batch.attention_mask == 0] == IGNORE_INDEX).all()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, attn_implementation="eager")).eval()
    with torch.no_grad():
        loss = model(input_ids=batch.input_ids, labels=batch.labels, attention_mask=batch.attention_mask).loss
        # By hand: each example alone (no padding), -log p(target) over the positions whose next label counts.
        total, count = torch.zeros((), dtype=torch.float64), 0
        for example in examples:
            ids, labels = torch.tensor([example["input_ids"]]), torch.tensor(example["labels"])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)  # (T, V)
            for t in range(len(labels) - 1):
                if labels[t + 1] != IGNORE_INDEX:
                    total -= logp[t, labels[t + 1]]
                    count += 1
    assert count == int((batch.labels[:, 1:] != IGNORE_INDEX).sum()) > 0
    assert loss.item() == pytest.approx((total / count).item(), rel=1e-5)


def test_padding_to_a_length() -> None:
    batch = pad_examples([{"input_ids": [5, 6], "labels": [-100, 6]}], pad_id=0, length=4)
    assert batch.input_ids.tolist() == [[5, 6, 0, 0]] and batch.labels.tolist() == [[-100, 6, -100, -100]]
    assert batch.attention_mask.tolist() == [[1, 1, 0, 0]] and batch.padding == 2
    with pytest.raises(ValueError, match="an example of 2 tokens is longer than length=1"):
        pad_examples([{"input_ids": [5, 6], "labels": [5, 6]}], pad_id=0, length=1)


# --- mistakes ---------------------------------------------------------------------------------------------


def test_bad_records_are_named(tmp_path: Path, tokenizer: Any) -> None:
    import datasets

    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps(PAIRS[1]) + "\n{'prompt': 'single quotes'}\n")
    with pytest.raises(DataError, match=r"bad.jsonl, line 3: not JSON \(Expecting property name enclosed in double "
                                        r"quotes, column 2\); each line of a JSON Lines file holds one JSON object"):
        read_records(bad_line)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl: "):
        read_records(tmp_path / "empty.jsonl")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text(json.dumps(PAIRS[0]) + "\n")
    datasets.Dataset.from_list(PAIRS).to_csv(str(tmp_path / "mixed" / "b.csv"), index=False)
    with pytest.raises(DataError, match=r"a folder of several formats \(csv, json\)"):
        read_records(tmp_path / "mixed")
    with pytest.raises(MissingFields, match=r"no column 'messages' or 'prompt'\+'completion' or 'text' \(the columns "
                                            r"found: 'question', 'answer'\)"):
        find_shape(["question", "answer"])
    with pytest.raises(DataError, match=r"its 'completion' \(column 'answer'\) is None, not a string"):
        tokenize_record({"question": "2 + 2?", "answer": None}, tokenizer, Shape.PROMPT_COMPLETION, max_length=8,
                        fields=Fields.parse("prompt=question,completion=answer"))


def test_a_role_the_template_refuses(tokenizer: Any) -> None:
    import datasets

    records = datasets.Dataset.from_list([{"messages": conversations()[0]},
                                          {"messages": [{"role": "tool", "content": "42"}]}])
    with pytest.raises(DataError, match="example 2: the chat template refuses it: the chat template knows the roles "
                                        "system, user and assistant, not 'tool'"):
        tokenize_records(records, tokenizer, Shape.MESSAGES, max_length=64)
    with pytest.raises(DataError, match=r"its message 1 is \{'role': 'user'\}, not a \{role, content\} pair"):
        render_chat(tokenizer, [{"role": "user"}])
    plain = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer, eos_token=EOS)
    with pytest.raises(DataError, match="the tokenizer has no chat template"):
        render_chat(plain, conversations()[0])


def test_import_bmtwrap_needs_no_datasets() -> None:
    code = "import sys, bmtwrap, bmtwrap.data; assert 'datasets' not in sys.modules, 'datasets imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
