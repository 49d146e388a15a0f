"""Normalising chat jsonl layouts; malformed rows name file and line; prepare's token store."""

from __future__ import annotations

import json

import pytest

from dspark_ds.data.config import DataConfig, PrepareConfig
from dspark_ds.data.formats import DataError, ReadStats, normalise_row, read_conversations
from dspark_ds.data.tokens import TokenStore, prepare

from helpers.tiny_models import build_tiny_tokenizer, chat_rows, write_chat_jsonl


def test_three_layouts_normalise_to_messages():
    msgs = chat_rows(1, "messages", seed=1, system=False)[0]["messages"]
    share = chat_rows(1, "conversations", seed=1, system=False)[0]
    turns = chat_rows(1, "turns", seed=1, system=False)[0]
    assert normalise_row(share, "f:1") == msgs
    assert normalise_row(turns, "f:1") == [m for m in msgs if m["role"] == "user"]
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    }
    assert normalise_row(parts, "f:1") == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize(
    "line,why",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"text": "x"}', "no 'messages'"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "alien", "content": "x"}]}', "unknown role"),
        ('{"messages": [{"role": "user"}]}', "role/content"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "start with a user turn"),
        ('{"messages": [{"role": "user", "content": 3}]}', "must be a string"),
        ('{"turns": [1]}', "list of strings"),
    ],
)
def test_malformed_row_error_names_file_and_line(tmp_path, line, why):
    path = tmp_path / "bad.jsonl"
    good = json.dumps(chat_rows(1)[0])
    path.write_text(f"{good}\n\n{good}\n{line}\n")
    with pytest.raises(DataError, match=rf"bad\.jsonl:4: .*{why}"):
        list(read_conversations([str(path)]))
    stats = ReadStats()
    rows = list(read_conversations([str(path)], skip_bad_rows=True, stats=stats))
    assert [r.source.rsplit(":", 1)[1] for r in rows] == ["1", "3"]
    assert [r.index for r in rows] == [0, 1]
    assert stats.bad == 1 and why.split()[0] in stats.errors[0]


def test_bytes_that_are_not_utf8_are_a_bad_row(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(chat_rows(1)[0]).encode()
    bad = '{"turns": ["caf\u00e9"]}'.encode("latin-1")  # é as the single byte 0xe9
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + bad + b"\n" + good + b"\n")  # with a BOM
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not valid UTF-8 \(byte 0xe9"):
        list(read_conversations([str(path)]))
    stats = ReadStats()
    rows = list(read_conversations([str(path)], skip_bad_rows=True, stats=stats))
    assert [r.source.rsplit(":", 1)[1] for r in rows] == ["1", "3"] and stats.bad == 1


def test_missing_empty_or_all_bad_inputs_are_named(tmp_path):
    with pytest.raises(DataError, match=r"data\.paths: .*nope\.jsonl does not exist"):
        list(read_conversations([str(tmp_path / "nope.jsonl")]))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl holds no rows \(empty\)"):
        list(read_conversations([str(tmp_path / "empty.jsonl")]))
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(DataError, match=r"all 1 rows .* are malformed \(first: .*bad\.jsonl:1"):
        list(read_conversations([str(tmp_path / "bad.jsonl")], skip_bad_rows=True))


def test_prepare_writes_a_store_that_matches_in_memory_tokenisation(tmp_path):
    build_tiny_tokenizer(tmp_path / "tok")
    src = write_chat_jsonl(tmp_path / "a.jsonl", 12)
    with open(src, "a") as f:
        f.write("garbage\n")
    data = DataConfig(paths=[src], tokenizer=str(tmp_path / "tok"), max_length=56)
    with pytest.raises(DataError, match=r"a\.jsonl:13"):
        prepare(PrepareConfig(data=data, output_dir=str(tmp_path / "prep")))
    data.skip_bad_rows = True
    counts = prepare(PrepareConfig(data=data, output_dir=str(tmp_path / "prep")))
    assert counts["bad_rows"] == 1 and counts["truncated"] > 0
    assert counts["samples"] + counts["skipped_few_loss_tokens"] == 12 and counts["samples"] > 3
    store = TokenStore.load(tmp_path / "prep")
    assert len(store) == counts["samples"] and max(store.lengths) == 56
    # readable by other users' jobs, like any file (safetensors alone writes 0600)
    assert (tmp_path / "prep" / "tokens.safetensors").stat().st_mode & 0o044 == 0o044
    # prompts-only rows have no assistant tokens: no usable sample, said as such
    only_prompts = tmp_path / "prompts.jsonl"
    only_prompts.write_text(json.dumps({"turns": ["hi"]}) + "\n")
    data = DataConfig(paths=[str(only_prompts)], tokenizer=str(tmp_path / "tok"))
    with pytest.raises(ValueError, match="no usable sample.*need `dspark-ds regenerate` first"):
        prepare(PrepareConfig(data=data, output_dir=str(tmp_path / "prep2")))
    assert store.meta["pad_token_id"] == 0 and store.meta["chat_format"] == "deepspec"
    assert not store.meta["generation_markers"]  # the reference's rule ignores the markers
    s = store[3]
    assert s["input_ids"].dtype == s["loss_mask"].dtype and len(s["input_ids"]) == store.lengths[3]
    assert 0 < int(s["loss_mask"].sum()) < len(s["loss_mask"])
