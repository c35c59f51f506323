"""Conversations rendered with the tokenizer's chat template, and which of their tokens are the assistant's.

A conversation is a list of ``{"role": ..., "content": ...}`` messages. Its tokens are exactly
``tokenizer.apply_chat_template(messages, tokenize=True)``'s. The assistant's tokens (the ones a
fine-tune learns to produce) are found in one of two ways:

- a template that marks them with ``{% generation %}`` ... ``{% endgeneration %}``: transformers'
  ``return_assistant_tokens_mask`` reads the marks;
- any other template, by rendering it incrementally: for each assistant turn, the conversation up to
  it with the generation prompt (what the model is given) and up to its end (what it should write).
  The characters between the two are the turn; the tokens that hold any of them are its tokens. This
  holds as long as the template renders the beginning of a conversation as the beginning of the
  whole; a template that does not (one that rewrites earlier turns) is refused with that reason.
"""

from __future__ import annotations

import re
from typing import Any, List, Mapping, Sequence, Tuple

from .read import DataError

SIMPLE_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception(\"the chat template knows the roles system, user and assistant, not '\" ~ message['role'] "
    "~ \"'\") }}"
    "{%- endif %}"
    "{{- '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ eos_token }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
"""A chat template for a tokenizer that has none (examples/finetune_hf.py's default tokenizer carries it).

Each message is its role between ``<|`` and ``|>``, a newline, its content and the end-of-text token;
the generation prompt opens an assistant turn: ``<|user|>\\nHello!<|endoftext|><|assistant|>\\n``.
Roles other than ``system``, ``user`` and ``assistant`` are refused.
"""

_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")

Messages = Sequence[Mapping[str, Any]]


def check_messages(messages: Any) -> List[dict]:
    """The conversation as a list of plain dicts; DataError for anything but messages with a role and a content."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"its messages are {'empty' if isinstance(messages, (list, tuple)) else repr(messages)}, not "
                        "a list of {role, content} messages")
    checked = []
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise DataError(f"its message {number} is {message!r}, not a {{role, content}} pair of strings")
        checked.append({k: v for k, v in message.items() if v is not None})
    return checked


def render_chat(tokenizer: Any, messages: Messages) -> Tuple[List[int], List[bool]]:
    """The conversation's token ids, as ``apply_chat_template`` gives them, and for each whether the assistant wrote it.

    Raises:
        DataError: the tokenizer has no chat template, the template refuses the conversation (a role
            it does not know, ...), or it renders a conversation's beginning differently from the whole.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError("the tokenizer has no chat template to render messages with")
    messages = check_messages(messages)
    try:
        if _GENERATION_MARK.search(template):
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        text, spans = assistant_spans(tokenizer, messages)
    except DataError:
        raise
    except Exception as error:  # jinja2's TemplateError, or raise_exception() in the template
        raise DataError(f"the chat template refuses it: {error}") from None
    return tokens_in_spans(tokenizer, text, spans)


def assistant_spans(tokenizer: Any, messages: List[dict]) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered conversation and the character spans ``[start, end)`` of its assistant turns."""
    render = lambda upto, prompt: tokenizer.apply_chat_template(  # noqa: E731
        messages[:upto], tokenize=False, add_generation_prompt=prompt)
    text = render(len(messages), False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(i, True) if i else ""  # a template cannot render an empty conversation
        through = render(i + 1, False)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(f"the chat template renders the conversation's first {i + 1} messages differently from "
                            "the beginning of the whole, so the assistant's tokens cannot be told apart; give a "
                            "template that marks them with {% generation %} ... {% endgeneration %}, or train on "
                            "every token")
        spans.append((len(before), len(through)))
    return text, spans


def tokens_in_spans(tokenizer: Any, text: str, spans: List[Tuple[int, int]],
                    add_special_tokens: bool = False) -> Tuple[List[int], List[bool]]:
    """``text``'s token ids and, for each, whether it holds characters of one of ``spans`` (character ranges).

    A token across a span's start (a prompt's last space merged into the completion's first word) is
    the span's: the model learns to write it.
    """
    if getattr(tokenizer, "is_fast", False):
        encoding = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        ids = list(encoding["input_ids"])
        inside = [any(start < e and end > s for s, e in spans) for start, end in encoding["offset_mapping"]]
        return ids, inside
    # A slow tokenizer gives no offsets: the tokens of each span's prefix must be a prefix of the whole's.
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    inside = [False] * len(ids)
    for start, end in spans:
        first, last = (len(tokenizer(text[:c], add_special_tokens=add_special_tokens)["input_ids"])
                       for c in (start, end))
        inside[first:last] = [True] * (last - first)
    return ids, inside
