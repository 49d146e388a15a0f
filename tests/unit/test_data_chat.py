"""Chat templating + loss masks: golden tests for ChatML (Qwen3) and Gemma, in the reference's
(DeepSpec) format and in the answer-only format."""

from __future__ import annotations

import pytest

from dspark_ds.data.chat import ChatTokenizer, load_tokenizer, spans_to_token_mask
from dspark_ds.data.config import DataConfig

from helpers.tiny_models import build_tiny_tokenizer, chat_rows

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello there!"},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
]

# (text, trained?) runs of the rendered conversation: the golden segmentation.
QWEN3_GOLDEN = [
    (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n",
        0,
    ),
    ("Hello there!<|im_end|>", 1),
    (
        "\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        0,
    ),
    ("Blue.<|im_end|>", 1),
    ("\n", 0),
]
GEMMA_GOLDEN = [
    ("<bos><|turn>user\nBe brief.\n\nHi!<turn|>\n<|turn>model\n", 0),
    ("Hello there!<turn|>", 1),
    ("\n<|turn>user\nName a color.<turn|>\n<|turn>model\n", 0),
    ("Blue.<turn|>", 1),
    ("\n", 0),
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for name in ("qwen3", "qwen3_nomarkers", "gemma"):
        d = tmp_path_factory.mktemp(name)
        build_tiny_tokenizer(d, template=name)
        out[name] = load_tokenizer(str(d))
    return out


def runs(tok, ids, mask):
    """Decode maximal runs of equal mask value → [(text, value)]."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            out.append((tok.decode(ids[start:i]), mask[start]))
            start = i
    return out


@pytest.mark.parametrize(
    "name,golden",
    [("qwen3", QWEN3_GOLDEN), ("qwen3_nomarkers", QWEN3_GOLDEN), ("gemma", GEMMA_GOLDEN)],
)
def test_golden_segmentation(tokenizers, name, golden):
    chat = ChatTokenizer(tokenizers[name], max_length=4096, chat_format="answer_only")
    assert chat.use_markers == (name == "qwen3")
    ids, mask = chat(CONV)
    assert runs(tokenizers[name], ids, mask) == golden


def test_markers_and_prefix_rendering_agree(tokenizers):
    """The {% generation %} mask and the prefix-rendering mask are the same on many chats."""
    with_markers = ChatTokenizer(tokenizers["qwen3"], 4096, chat_format="answer_only")
    derived = ChatTokenizer(
        tokenizers["qwen3"], 4096, use_generation_markers=False, chat_format="answer_only"
    )
    assert with_markers.use_markers and not derived.use_markers
    for row in chat_rows(40, seed=3):
        assert with_markers(row["messages"]) == derived(row["messages"])


@pytest.mark.parametrize("name", ["qwen3", "qwen3_nomarkers", "gemma"])
def test_mask_never_covers_system_or_user(tokenizers, name):
    tok = tokenizers[name]
    chat = ChatTokenizer(tok, 4096, chat_format="answer_only")
    for row in chat_rows(40, seed=5):
        msgs = row["messages"]
        ids, mask = chat(msgs)
        trained = [t for t, v in runs(tok, ids, mask) if v]
        eot = "<|im_end|>" if name.startswith("qwen3") else "<turn|>"
        assert trained == [m["content"] + eot for m in msgs if m["role"] == "assistant"]
        untrained = "".join(t for t, v in runs(tok, ids, mask) if not v)
        for m in msgs:
            if m["role"] != "assistant":
                assert m["content"] in untrained


def test_truncation_and_system_prompt(tokenizers):
    tok = tokenizers["qwen3"]
    for fmt in ("answer_only", "deepspec"):
        full_ids, full_mask = ChatTokenizer(tok, 4096, chat_format=fmt)(CONV[1:])
        ids, mask = ChatTokenizer(tok, 20, chat_format=fmt)(CONV[1:])
        assert len(ids) == 20 and ids == full_ids[:20] and mask == full_mask[:20]
        ids, _ = ChatTokenizer(tok, 4096, system_prompt="Be brief.", chat_format=fmt)(CONV[1:])
        assert ids == ChatTokenizer(tok, 4096, chat_format=fmt)(CONV)[0]


def test_spans_to_token_mask_overlap_rule():
    offsets = [(0, 2), (2, 5), (5, 6), (6, 6), (6, 9)]
    assert spans_to_token_mask(offsets, [(3, 6)]) == [0, 1, 1, 0, 0]
    assert spans_to_token_mask(offsets, [(0, 1), (8, 9)]) == [1, 0, 0, 0, 1]


# ---- the reference's (DeepSpec) training text ---------------------------------------------------

TWO_TURNS = CONV[1:]  # no system message: the ChatML default one is added

# The reference's rule written out by hand: the default system prompt; each answer trained from
# after "<|im_start|>assistant\n" through "<|im_end|>\n", the last one's empty think block included.
QWEN3_REFERENCE = [
    (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!"
        "<|im_end|>\n<|im_start|>assistant\n",
        0,
    ),
    ("Hello there!<|im_end|>\n", 1),
    ("<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n", 0),
    ("<think>\n\n</think>\n\nBlue.<|im_end|>\n", 1),
]
# Gemma4: no system prompt; every answer behind the empty thought channel, which is not trained.
GEMMA_REFERENCE = [
    ("<bos><|turn>user\nHi!<turn|>\n<|turn>model\n<|channel>thought\n<channel|>", 0),
    ("Hello there!<turn|>\n", 1),
    ("<|turn>user\nName a color.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>", 0),
    ("Blue.<turn|>\n", 1),
]


def _expected(tok, golden):
    """Token ids and mask of hand-written (text, trained) segments, each encoded alone."""
    ids, mask = [], []
    for text, value in golden:
        seg = tok(text, add_special_tokens=False)["input_ids"]
        ids += seg
        mask += [value] * len(seg)
    return ids, mask


@pytest.mark.parametrize(
    "name,golden",
    [("qwen3", QWEN3_REFERENCE), ("qwen3_nomarkers", QWEN3_REFERENCE), ("gemma", GEMMA_REFERENCE)],
)
def test_reference_format_exact_ids_and_mask(tokenizers, name, golden):
    tok = tokenizers[name]
    ids, mask = ChatTokenizer(tok, 4096, chat_format="deepspec")(TWO_TURNS)
    assert (ids, mask) == _expected(tok, golden)
    assert runs(tok, ids, mask) == golden


def _reference_by_prefix_encoding(tok, text, header, eot, prefix=""):
    """A naive transcription of the reference's rule: regex spans, token indices by encoding the
    text before each span boundary."""
    import re

    ids = tok(text, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    pattern = re.escape(header) + r"([\s\S]*?(?:" + re.escape(eot) + "|$))"
    for m in re.finditer(pattern, text):
        start = m.start(1)
        if prefix and text.startswith(prefix, start):
            start += len(prefix)
        a = len(tok(text[:start], add_special_tokens=False)["input_ids"])
        b = len(tok(text[: m.end(1)], add_special_tokens=False)["input_ids"])
        mask[a:b] = [1] * (b - a)
    return ids, mask


@pytest.mark.parametrize("name", ["qwen3", "gemma"])
def test_reference_format_matches_prefix_encoding_on_many_chats(tokenizers, name):
    tok = tokenizers[name]
    chat = ChatTokenizer(tok, 4096, chat_format="deepspec")
    ref = chat.reference
    for row in chat_rows(40, seed=7):
        msgs = row["messages"]
        ids, mask = chat(msgs)
        if name == "qwen3" and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": "You are a helpful assistant."}, *msgs]
        msgs = [
            {**m, "content": ref.answer_prefix + m["content"]} if m["role"] == "assistant" else m
            for m in msgs
        ]
        text = chat.render(msgs)
        expect = _reference_by_prefix_encoding(
            tok, text, ref.assistant_header, ref.end_of_turn, ref.answer_prefix
        )
        assert (ids, mask) == expect
        assert sum(mask) > 0


def test_chat_format_default_and_refusals(tokenizers, tmp_path):
    assert DataConfig().chat_format == "deepspec"
    with pytest.raises(ValueError, match="data.chat_format"):
        DataConfig(chat_format="chatml")
    # A template that is neither ChatML nor Gemma4: the reference rule does not apply.
    tok = tokenizers["qwen3"]
    saved = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        with pytest.raises(ValueError, match="answer_only"):
            ChatTokenizer(tok, 4096, chat_format="deepspec")
        assert ChatTokenizer(tok, 4096, chat_format="answer_only").reference is None
    finally:
        tok.chat_template = saved
