"""Chat templating + assistant-only loss masks: golden tests for ChatML (Qwen3) and Gemma."""

from __future__ import annotations

import pytest

from dspark_ds.data.chat import ChatTokenizer, load_tokenizer, spans_to_token_mask

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
    chat = ChatTokenizer(tokenizers[name], max_length=4096)
    assert chat.use_markers == (name == "qwen3")
    ids, mask = chat(CONV)
    assert runs(tokenizers[name], ids, mask) == golden


def test_markers_and_prefix_rendering_agree(tokenizers):
    """The {% generation %} mask and the prefix-rendering mask are the same on many chats."""
    with_markers = ChatTokenizer(tokenizers["qwen3"], 4096)
    derived = ChatTokenizer(tokenizers["qwen3"], 4096, use_generation_markers=False)
    assert with_markers.use_markers and not derived.use_markers
    for row in chat_rows(40, seed=3):
        assert with_markers(row["messages"]) == derived(row["messages"])


@pytest.mark.parametrize("name", ["qwen3", "qwen3_nomarkers", "gemma"])
def test_mask_never_covers_system_or_user(tokenizers, name):
    tok = tokenizers[name]
    chat = ChatTokenizer(tok, 4096)
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
    full_ids, full_mask = ChatTokenizer(tok, 4096)(CONV[1:])
    ids, mask = ChatTokenizer(tok, 20)(CONV[1:])
    assert len(ids) == 20 and ids == full_ids[:20] and mask == full_mask[:20]
    ids, _ = ChatTokenizer(tok, 4096, system_prompt="Be brief.")(CONV[1:])
    assert ids == ChatTokenizer(tok, 4096)(CONV)[0]


def test_spans_to_token_mask_overlap_rule():
    offsets = [(0, 2), (2, 5), (5, 6), (6, 6), (6, 9)]
    assert spans_to_token_mask(offsets, [(3, 6)]) == [0, 1, 1, 0, 0]
    assert spans_to_token_mask(offsets, [(0, 1), (8, 9)]) == [1, 0, 0, 0, 1]
