"""Render conversations with the target's chat template and mark the tokens trained on.

Two formats (``data.chat_format``):

``deepspec`` (default): the training text of the reference implementation (DeepSpec), so τ is
comparable with the paper's. The conversation is rendered by the tokenizer's own template and
the loss mask runs from right after the assistant header through the end-of-turn text, its
newline included, for every assistant turn:

- ChatML (Qwen3): a conversation without a system message gets ``You are a helpful
  assistant.``; the mask runs from after ``<|im_start|>assistant\n`` through ``<|im_end|>\n``,
  so it covers Qwen3's empty ``<think>\n\n</think>\n\n`` block where the template emits it.
- Gemma4: no system prompt is added; every answer is rendered behind the empty thought channel
  ``<|channel>thought\n<channel|>`` (what Gemma4 emits in non-thinking mode), and the mask runs
  from after that prefix through ``<turn|>\n``.

A token is trained when its first character lies inside a span (the reference encodes text
prefixes; the two agree whenever a span boundary is a token boundary, which special tokens and
the header's newline make the rule).

``answer_only`` (the earlier behaviour): no default system prompt, the mask covers the answer and
its end-of-turn token only (``<|im_end|>``, ``<turn|>``), never template-forced text such as the
empty ``<think>`` block nor the trailing newline. Two ways to find those tokens, both ending in
the same character-span → token rule (a token counts when its characters overlap a span, as in
``transformers``):

1. The template has ``{% generation %}`` markers: use its assistant mask.
2. Otherwise derive the spans by rendering prefixes: for assistant turn ``i``, the render of
   ``messages[:i]`` with the generation prompt shares its header with the full render; the
   answer starts where its content appears after that header and ends after the end-of-turn
   text the template emits after it (trailing whitespace excluded).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dspark_ds.data.formats import DataError
from dspark_ds.errors import ConfigError

_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")

CHAT_FORMATS = ("deepspec", "answer_only")


@dataclass(frozen=True)
class ReferenceTurns:
    """How the reference (DeepSpec) finds the trained text of one template family."""

    family: str
    assistant_header: str
    end_of_turn: str
    system_prompt: str | None = None
    """Added to conversations that have no system message."""
    answer_prefix: str = ""
    """Rendered before every answer (and not trained on)."""


REFERENCE_TURNS = {
    "chatml": ReferenceTurns(
        "chatml", "<|im_start|>assistant\n", "<|im_end|>\n", "You are a helpful assistant."
    ),
    "gemma4": ReferenceTurns(
        "gemma4", "<|turn>model\n", "<turn|>\n", answer_prefix="<|channel>thought\n<channel|>"
    ),
}


def reference_turns(chat_template: str) -> ReferenceTurns:
    """The reference rule for a tokenizer's chat template (ChatML / Qwen3 or Gemma4)."""
    if "<|im_start|>" in chat_template:
        return REFERENCE_TURNS["chatml"]
    if "<|turn>" in chat_template:
        return REFERENCE_TURNS["gemma4"]
    raise ConfigError(
        "data.chat_format=deepspec knows ChatML (Qwen3) and Gemma4 chat templates, and this "
        "tokenizer has neither; use data.chat_format=answer_only"
    )


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    # lazy: transformers, 0.9 s of import
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if not getattr(tok, "is_fast", False):
        raise ConfigError(
            f"tokenizer {name_or_path!r} is not a fast tokenizer; loss masks need character offsets"
        )
    if not tok.chat_template:
        raise ConfigError(f"tokenizer {name_or_path!r} has no chat template")
    return tok


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _spans_mask(
    offsets: list[tuple[int, int]], spans: list[tuple[int, int]], overlap: bool
) -> list[int]:
    """1 for every non-empty token with its first character (``overlap``: any character) inside
    one of the sorted ``spans``."""
    mask = [0] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        # the span ends after `start`: the token is in it when its first (overlap: last)
        # character is at or after the span's start
        if (end - 1 if overlap else start) >= spans[k][0] and end > start:
            mask[t] = 1
    return mask


def spans_to_start_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose first character lies inside one of the sorted ``spans``."""
    return _spans_mask(offsets, spans, overlap=False)


def spans_to_token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose character range overlaps one of the sorted ``spans``."""
    return _spans_mask(offsets, spans, overlap=True)


class ChatTokenizer:
    """``messages`` → (``input_ids``, ``loss_mask``), truncated to ``max_length``.

    ``chat_format`` is ``deepspec`` or ``answer_only`` (module docstring). ``system_prompt``
    overrides the format's default system prompt for conversations that have none.
    """

    def __init__(
        self,
        tokenizer,
        max_length: int,
        enable_thinking: bool = False,
        system_prompt: str | None = None,
        use_generation_markers: bool | None = None,
        chat_format: str = "deepspec",
    ):
        if chat_format not in CHAT_FORMATS:
            raise ConfigError(
                f"data.chat_format must be one of {CHAT_FORMATS}, got {chat_format!r}"
            )
        self.tok = tokenizer
        self.max_length = max_length
        self.template_kwargs = {"enable_thinking": enable_thinking}
        self.system_prompt = system_prompt
        self.chat_format = chat_format
        self.reference = (
            reference_turns(tokenizer.chat_template or "") if chat_format == "deepspec" else None
        )
        has_markers = bool(_GENERATION_RE.search(tokenizer.chat_template or ""))
        self.use_markers = self.reference is None and (
            has_markers
            if use_generation_markers is None
            else (use_generation_markers and has_markers)
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def with_system(self, messages: list[dict]) -> list[dict]:
        if self.system_prompt and messages[0]["role"] != "system":
            return [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def assistant_spans(self, messages: list[dict], text: str, where: str = "") -> list[tuple]:
        """Character spans of the assistant answers (content + end-of-turn) in ``text``."""
        spans, pos = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            header = self.render(messages[:i], add_generation_prompt=True)
            search_from = max(pos, _common_prefix_len(text, header))
            content = m["content"]
            start = text.find(content, search_from) if content else -1
            if start < 0 and content.strip():
                content = content.strip()
                start = text.find(content, search_from)
            if start < 0:
                raise DataError(
                    f"{where}: assistant message {i} not found in the rendered chat "
                    "template (the template rewrites it); use a template with "
                    "{% generation %} markers"
                )
            end = start + len(content)
            # The end-of-turn text the template emits right after this answer.
            alone = self.render(messages[: i + 1])
            eot = alone[alone.rfind(content) + len(content) :].rstrip()
            n = _common_prefix_len(text[end : end + len(eot)], eot)
            end += len(text[end : end + n].rstrip())
            spans.append((start, end))
            pos = end
        return spans

    def reference_spans(self, text: str) -> list[tuple[int, int]]:
        """The reference's spans: after each assistant header (and answer prefix) through the
        end-of-turn text, or through the end of ``text`` when a turn is not closed."""
        ref = self.reference
        spans, pos = [], 0
        while (head := text.find(ref.assistant_header, pos)) >= 0:
            start = head + len(ref.assistant_header)
            eot = text.find(ref.end_of_turn, start)
            end = len(text) if eot < 0 else eot + len(ref.end_of_turn)
            if ref.answer_prefix and text.startswith(ref.answer_prefix, start):
                start += len(ref.answer_prefix)
            if start < end:
                spans.append((start, end))
            pos = end
        return spans

    def _reference_call(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        ref = self.reference
        system = self.system_prompt or ref.system_prompt
        if system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}, *messages]
        if ref.answer_prefix:
            messages = [
                {**m, "content": ref.answer_prefix + m["content"]}
                if m["role"] == "assistant" and not m["content"].startswith(ref.answer_prefix)
                else m
                for m in messages
            ]
        text = self.render(messages)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = spans_to_start_mask(enc["offset_mapping"], self.reference_spans(text))
        return list(enc["input_ids"]), mask

    def __call__(self, messages: list[dict], where: str = "") -> tuple[list[int], list[int]]:
        if self.reference is not None:
            ids, mask = self._reference_call(messages)
            return ids[: self.max_length], mask[: self.max_length]
        messages = self.with_system(messages)
        if self.use_markers:
            out = self.tok.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **self.template_kwargs,
            )
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            text = self.render(messages)
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            mask = spans_to_token_mask(
                enc["offset_mapping"], self.assistant_spans(messages, text, where)
            )
        return ids[: self.max_length], mask[: self.max_length]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Tokens of ``messages`` followed by the generation prompt (for regeneration)."""
        text = self.render(self.with_system(messages), add_generation_prompt=True)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])
