"""The speculators-format tests' helpers (tests/unit/ and tests/e2e/test_speculators_interop.py).

- ``make_drafter(name, target)``: the drafters the format covers, random, for a loaded target
  (``<name>_reduced``: over a reduced draft vocabulary, ``draft_ids``).

speculators 0.9.0 in its own environment:

- ``require_speculators() -> str``: the Python of the speculators environment ``tools/install.sh``
  makes (``$DSPARK_DS_SPECULATORS_ENV``, default ~/.cache/dspark-ds/speculators-venv); fails the
  test, naming the install command, when there is none.
- ``run_probe(jobs, work) -> str``: runs helpers/speculators_probe.py there on `jobs` (written to
  `work`/jobs.json); fails the test with the tail of its output when it does not finish.

- ``load_peer_compare(monkeypatch)``: tools/peer_compare.py imported as the module
  `peer_compare` (for this test only).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark_ds.drafters import build_draft_config, build_draft_model
from dspark_ds.drafters.common.vocab import vocab_maps
from dspark_ds.drafters.eagle3.build import build_eagle3_config

from helpers.drafters import with_target_weights
from helpers.system import INSTALL

DEFAULT_ENV = "~/.cache/dspark-ds/speculators-venv"
PROBE = Path(__file__).with_name("speculators_probe.py")


def require_speculators() -> str:
    env = Path(os.environ.get("DSPARK_DS_SPECULATORS_ENV") or DEFAULT_ENV).expanduser()
    python = env / "bin" / "python"
    if not python.exists() or not list(env.glob("lib/python*/site-packages/speculators")):
        pytest.fail(
            f"speculators not installed: run `{INSTALL}` (it makes the speculators "
            f"environment, {DEFAULT_ENV}; or set DSPARK_DS_SPECULATORS_ENV)",
            pytrace=False,
        )
    return str(python)


def run_probe(jobs: dict, work: Path, timeout_s: float = 240.0) -> str:
    python = require_speculators()
    jobs_file = Path(work) / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [python, str(PROBE), str(jobs_file)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=work,
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        pytest.fail("speculators probe failed:\n" + "\n".join(tail), pytrace=False)
    return proc.stdout


def draft_ids(vocab: int, n: int = 200) -> list[int]:
    """A reduced draft vocabulary's target ids: `n` of them, at random (seeded)."""
    g = torch.Generator().manual_seed(0)
    return sorted(torch.randperm(vocab, generator=g)[:n].tolist())


def _spread(model, target, seed: int):
    torch.manual_seed(seed)
    if getattr(model, "draft_vocab", 0):
        ids = torch.tensor(draft_ids(target.config.vocab_size, model.draft_vocab))
        model.set_draft_vocab(vocab_maps(ids, target.config.vocab_size)[0])
    return with_target_weights(model, target)


def make_drafter(name: str, target):
    """The drafters the format covers: DSpark (vanilla / gated / RNN Markov heads), DFlash in
    both layouts, Eagle3; two or three tapped layers, -1 (the embedding output) among them;
    `<name>_reduced`: the same over a reduced draft vocabulary (`draft_ids`)."""
    cfg = target.config
    name, reduced = name.removesuffix("_reduced"), name.endswith("_reduced")
    vocab = {"draft_vocab_size": len(draft_ids(cfg.vocab_size)) if reduced else None}
    if name == "eagle3":
        draft = build_eagle3_config(cfg, target_layer_ids=[-1, 1, 2], num_draft_layers=1, **vocab)
        return _spread(build_draft_model(draft), target, 3)
    heads = dict(markov_rank=8, confidence_head_alpha=1.0, confidence_head_with_markov=True)
    fields = {
        "dspark": dict(heads, markov_head_type="vanilla"),
        "dspark_gated": dict(heads, markov_head_type="gated", sample_from_anchor=False),
        "dspark_rnn": dict(heads, markov_head_type="rnn"),
        "dflash": dict(markov_rank=0, confidence_head_alpha=0.0, sample_from_anchor=False),
        "dflash_anchor": dict(markov_rank=0, confidence_head_alpha=0.0),
    }[name]
    fields.setdefault("confidence_head_with_markov", False)
    draft = build_draft_config(
        cfg,
        target_layer_ids=[0, 2] if name != "dflash" else [-1, 1, 2],
        mask_token_id=cfg.vocab_size - 1,
        num_draft_layers=2,
        block_size=4,
        num_anchors=8,
        **fields,
        **vocab,
    )
    return _spread(build_draft_model(draft), target, 1)


PEER_COMPARE = Path(__file__).resolve().parents[2] / "tools" / "peer_compare.py"


def load_peer_compare(monkeypatch):
    """tools/peer_compare.py as the module `peer_compare`, in sys.modules for this test only."""
    spec = importlib.util.spec_from_file_location("peer_compare", PEER_COMPARE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "peer_compare", module)  # its dataclass looks itself up
    spec.loader.exec_module(module)
    return module
