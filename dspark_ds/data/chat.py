"""Render conversations with the target's chat template; loss mask = the assistant tokens only.

Two ways to find the assistant tokens, both ending in the same character-span → token rule
(a token counts when its characters overlap a span, as in ``transformers``):

1. The template has ``{% generation %}`` markers: use its assistant mask.
2. Otherwise derive the spans by rendering prefixes: for assistant turn ``i``, the render of
   ``messages[:i]`` with the generation prompt shares its header with the full render; the
   answer starts where its content appears after that header and ends after the end-of-turn
   text the template emits after it (``<|im_end|>``, ``<turn|>``, …; trailing whitespace
   excluded). Template-forced text such as Qwen3's empty ``<think>`` block is not trained on.
"""

from __future__ import annotations

import re

from dspark_ds.data.formats import DataError

_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if not getattr(tok, "is_fast", False):
        raise ValueError(
            f"tokenizer {name_or_path!r} is not a fast tokenizer; loss masks need character offsets"
        )
    if not tok.chat_template:
        raise ValueError(f"tokenizer {name_or_path!r} has no chat template")
    return tok


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def spans_to_token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose character range overlaps one of the sorted ``spans``."""
    mask = [0] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0] and end > start:
            mask[t] = 1
    return mask


class ChatTokenizer:
    """``messages`` → (``input_ids``, ``loss_mask``), truncated to ``max_length``."""

    def __init__(
        self,
        tokenizer,
        max_length: int,
        enable_thinking: bool = False,
        system_prompt: str | None = None,
        use_generation_markers: bool | None = None,
    ):
        self.tok = tokenizer
        self.max_length = max_length
        self.template_kwargs = {"enable_thinking": enable_thinking}
        self.system_prompt = system_prompt
        has_markers = bool(_GENERATION_RE.search(tokenizer.chat_template or ""))
        self.use_markers = (
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

    def __call__(self, messages: list[dict], where: str = "") -> tuple[list[int], list[int]]:
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
