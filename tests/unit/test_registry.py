"""The drafter kinds: one per name, found by name or from a model; each kind honours the `perf`
section or refuses an option by name; the kind's training step equals the direct call."""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import asdict, fields, replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dspark_ds.config import TrainConfig
from dspark_ds.data.config import DataConfig
from dspark_ds.drafters.common.memory import StepShape, Widths
from dspark_ds.drafters.common.registration import CONFIDENCE_HEAD
from dspark_ds.drafters.dspark.config import LossWeights
from dspark_ds.drafters.dspark.loss import compute_dspark_loss
from dspark_ds.drafters.dspark.step import sample_anchors
from dspark_ds.drafters.eagle3 import loss as eagle3_loss
from dspark_ds.drafters.eagle3.build import build_eagle3_config
from dspark_ds.drafters.io import build_draft_model
from dspark_ds.drafters.kind import StepContext
from dspark_ds.drafters.perf import PerfConfig
from dspark_ds.drafters.presets import PRESET_NAMES, PRESETS, preset
from dspark_ds.drafters.registry import KINDS, REGISTERED, get_kind, kind_of

from helpers.drafters import random_batch, tiny_drafter, tiny_qwen3_config
from helpers.evaluation import cpu_eval

LAYER_IDS = [-1, 1, 2]


def tiny_eagle3(ttt_length: int = 3):
    cfg = build_eagle3_config(
        tiny_qwen3_config(), target_layer_ids=LAYER_IDS, ttt_length=ttt_length
    )
    torch.manual_seed(0)
    model = build_draft_model(cfg)
    model.freeze_shared()
    return model


def test_kinds_by_name_and_by_model():
    assert list(KINDS) == ["dspark", "eagle3"]
    assert kind_of(tiny_drafter()) is get_kind("dspark")
    # a DeepSpeed engine is looked through (`.module`)
    assert kind_of(SimpleNamespace(module=tiny_eagle3())) is get_kind("eagle3")
    with pytest.raises(ValueError, match="model.kind"):
        get_kind("medusa")
    with pytest.raises(ValueError, match="drafter"):
        kind_of(torch.nn.Linear(2, 2))


def test_each_kind_declares_what_it_can_do_as_data():
    # read from its registration, before any of its code is imported; the kind serves the same
    for name, registration in REGISTERED.items():
        caps = registration.capabilities
        assert get_kind(name).capabilities is caps and caps.label
        for variant in caps.bench_variants:  # each variant a path the kind honours
            attention, loss = variant.split("/")
            assert attention in caps.attn_impls and loss in caps.loss_impls
    dspark, eagle3 = REGISTERED["dspark"].capabilities, REGISTERED["eagle3"].capabilities
    assert (dspark.drafting, dspark.anchor_blocks, dspark.uses_mask_token) == (
        "parallel",
        True,
        True,
    )
    assert (eagle3.drafting, eagle3.anchor_blocks, eagle3.uses_mask_token) == (
        "unrolled",
        False,
        False,
    )
    assert CONFIDENCE_HEAD in dspark.heads and dspark.block_layouts == ("anchor", "fill-in")
    assert eagle3.heads == eagle3.block_layouts == ()
    assert "recompute" in dspark.loss_impls and "recompute" not in eagle3.loss_impls


def test_the_kind_answers_what_a_built_drafter_drafts_and_scores():
    """What evaluation sizes a round by and whether it can cut on confidence: the kind's answer
    from the drafter's config, which holds no size it does not have (Eagle3: no block_size)."""
    with_head, without = tiny_drafter(), tiny_drafter(confidence_head_alpha=0.0)
    eagle3 = tiny_eagle3(ttt_length=3)
    for drafter, tokens, scores in ((with_head, 4, True), (without, 4, False), (eagle3, 3, False)):
        decode = kind_of(drafter).decode
        assert decode.tokens_per_round(drafter.config) == tokens
        assert decode.has_confidence(drafter.config) is scores
    assert (without.confidence_head is None) and (with_head.confidence_head is not None)
    assert not hasattr(eagle3.config, "block_size")


@pytest.mark.parametrize(
    ("name", "architecture"), [("dspark", "Qwen3DSparkModel"), ("eagle3", "Qwen3Eagle3Model")]
)
def test_build_config_gives_the_kind_its_architecture(name, architecture):
    kind = get_kind(name)
    cfg = kind.build_config(
        tiny_qwen3_config(),
        preset(name, num_draft_layers=1),
        target_layer_ids=LAYER_IDS,
        mask_token_id=5,
        target_path="some/target",
    )
    assert cfg.architectures == [architecture] == [kind.architectures["qwen3"]]
    assert isinstance(build_draft_model(cfg), kind.model_class)


@pytest.mark.parametrize(
    ("option", "value"), [("loss_impl", "recompute"), ("attn_implementation", "blockwise")]
)
def test_eagle3_refuses_perf_options_it_cannot_honour(option, value):
    perf = PerfConfig(**{option: value})
    get_kind("dspark").train.check_perf(perf)  # DSpark has both
    with pytest.raises(ValueError, match=f"perf.{option}: '{value}' is not available for eagle3"):
        get_kind("eagle3").train.check_perf(perf)


def test_eagle3_honours_perf():
    kind, model = get_kind("eagle3"), tiny_eagle3()
    assert kind.train.prepare(model, PerfConfig()) == "chunked"
    assert kind.train.prepare(model, PerfConfig(loss_impl="reference")) == "reference"
    # flex, not what a CPU drafter picks by itself (dense), so a dropped option shows
    assert model.resolve_attn_implementation(torch.device("cpu")) == "dense"
    kind.train.prepare(model, PerfConfig(attn_implementation="flex"))
    assert model.resolve_attn_implementation(torch.device("cpu")) == "flex"
    assert eagle3_loss.loss_impl_for("auto", zero3=True) == "reference"
    with pytest.raises(ValueError, match="perf.loss_impl: chunked .* under ZeRO-3"):
        eagle3_loss.loss_impl_for("chunked", zero3=True)
    # the run's ZeRO stage is passed down, not read off the parameters
    assert kind.train.prepare(model, PerfConfig(), zero_stage=3) == "reference"
    with pytest.raises(ValueError, match="under ZeRO-3"):
        kind.train.prepare(model, PerfConfig(loss_impl="chunked"), zero_stage=3)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_each_kind_gives_its_step_shape_part_and_its_tags(name):
    # what the tuner and evaluation ask of a kind: its part of the StepShape from the run's
    # `model` section (read by its activation and FLOP terms), its eval tags from a drafter
    model = preset(name, num_draft_layers=1, num_anchors=8, block_size=4, ttt_length=3)
    kind = get_kind(model.kind)
    shape = StepShape.of(Widths(64, 160, 1000, 4, 2, 16, 1, 3), 1, 32, kind.cost.step_part(model))
    for stage in (0, 3):
        assert sum(kind.cost.activation_bytes(shape, PerfConfig(), "cpu", stage).values()) > 0
        assert sum(kind.cost.step_flops(shape, PerfConfig(), "cpu", stage).values()) > 0
    bigger_part = kind.cost.step_part(replace(model, num_anchors=16, block_size=8, ttt_length=6))
    bigger = StepShape(**{**shape.__dict__, "drafter": bigger_part})
    assert sum(kind.cost.step_flops(bigger, PerfConfig(), "cpu", 0).values()) > sum(
        kind.cost.step_flops(shape, PerfConfig(), "cpu", 0).values()
    )
    drafter = tiny_eagle3(3) if model.kind == "eagle3" else tiny_drafter()
    tags = kind.report.tags(drafter.config)
    assert tags and all(v is not None for v in tags.values())


def test_eagle3_chunk_size_comes_from_perf(monkeypatch):
    """perf.loss_chunk_anchors positions of T steps each: loss_chunk_anchors × T rows."""
    model = tiny_eagle3(ttt_length=3)
    batch = random_batch(model, batch=2, seq_len=12)
    seen = []
    original = eagle3_loss.chunked_eagle3_loss

    def spy(*args, chunk_rows, **kwargs):
        seen.append(chunk_rows)
        return original(*args, chunk_rows=chunk_rows, **kwargs)

    monkeypatch.setattr(eagle3_loss, "chunked_eagle3_loss", spy)
    losses = {}
    for impl in ("chunked", "reference"):
        ctx = StepContext(preset("eagle3"), PerfConfig(loss_chunk_anchors=2), loss_impl=impl)
        losses[impl] = get_kind("eagle3").train.training_step(model, batch, ctx).loss
    assert seen == [6]
    torch.testing.assert_close(losses["chunked"], losses["reference"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_the_loss_options_reach_each_kinds_step(kind):
    """model.loss_terms / lk_eta (and DSpark's loss_schedule) are what the step trains on."""
    model = tiny_drafter() if kind == "dspark" else tiny_eagle3()
    batch = random_batch(model, batch=2, seq_len=16)
    batch["sample_ids"] = torch.tensor([0, 1])
    extra = {"loss_schedule": "dpace"} if kind == "dspark" else {}
    losses = {}
    for name, terms in (("plain", {}), ("terms", {"tv": 2.0, "lk": 1.0})):
        m = preset(kind, loss_terms=terms, lk_eta=1.0, **extra)
        ctx = StepContext(model=m, perf=PerfConfig(), loss_impl="chunked", seed=1)
        out = get_kind(kind).train.training_step(model, batch, ctx)
        metrics = get_kind(kind).train.metrics(out.global_sums(), m)
        assert metrics["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
        losses[name] = (out.loss.item(), metrics)
    (plain, _), (with_terms, m) = losses["plain"], losses["terms"]
    assert with_terms == pytest.approx(plain + 2.0 * m["tv_loss"] + m["lk_loss"], rel=1e-5)
    assert "tv_loss" not in losses["plain"][1]


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_each_presets_speculators_loss_is_a_valid_loss_of_its_kind(name):
    """`Preset.speculators_loss` (the demo's --loss speculators) sets fields its kind reads, each
    to another value than the preset's, and the section stays valid; `Preset.demo_loss` is
    a valid loss of its kind too."""
    own, theirs = preset(name), PRESETS[name].speculators_loss
    assert theirs and set(theirs) <= set(own.kind_fields())
    assert all(getattr(own, k) != v for k, v in theirs.items()), theirs
    preset(name, **theirs).validate()
    measured = PRESETS[name].demo_loss
    assert set(measured) <= set(own.kind_fields())
    preset(name, **measured).validate()
    # its measured order: `data` fields, and a valid data section with them
    order = PRESETS[name].demo_data
    assert set(order) <= {f.name for f in fields(DataConfig)}
    DataConfig(paths=["x"], **order)  # validated on construction
    # its measured optimizer settings: `train` fields, other than the default, and valid
    train = PRESETS[name].demo_train
    assert set(train) <= {f.name for f in fields(TrainConfig)}
    assert all(getattr(TrainConfig(), k) != v for k, v in train.items()), train
    TrainConfig(**train).validate()


def test_dspark_step_samples_anchors_per_sample_and_uses_the_loss_weights():
    model = tiny_drafter()
    batch = random_batch(model, batch=2, seq_len=24)
    batch["sample_ids"] = torch.tensor([7, 3])
    m = preset("dflash")  # not the loss functions' defaults
    ctx = StepContext(model=m, perf=PerfConfig(), loss_impl="reference", seed=5, epoch=2)
    out = get_kind("dspark").train.training_step(model, batch, ctx)
    loss, metrics = out.loss, get_kind("dspark").train.metrics(out.global_sums(), m)
    anchors, keep = sample_anchors(batch["loss_mask"], batch["sample_ids"], 6, seed=5, epoch=2)
    inputs = {k: v for k, v in batch.items() if k != "sample_ids"}
    out = model(**inputs, anchor_positions=anchors, block_keep_mask=keep)
    ref, ref_metrics = compute_dspark_loss(out, **asdict(LossWeights.of(m)))
    assert torch.equal(loss, ref)  # the trainer's on-device step is the reference, bit for bit
    assert metrics == ref_metrics and metrics["supervised_tokens"] > 0


@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_host_work_grows_in_what_the_kind_says(name):
    """The tuner's narrow copies run at two counts of the kind's host scale (DSpark: anchors,
    Eagle3: positions) and extrapolate: the line through them predicts a third copy's ops."""
    from dspark_ds.tune.workload import SCALE_POINTS, KindStep, OpCounter, at_scale, counted_perf

    kind = get_kind(name)
    model = preset(name, num_draft_layers=1, num_anchors=128, block_size=4, ttt_length=3)
    perf = counted_perf(PerfConfig(), "cpu")  # the CPU's paths: chunked loss, blockwise / dense
    scale = kind.cost.host_scale(model, 256)
    assert scale == (128 if name == "dspark" else 256)

    def ops(count: int) -> int:
        copy, seq_len = kind.cost.host_copy(model, 256, count, SCALE_POINTS[-1])
        target_cfg = tiny_qwen3_config(max_position_embeddings=512)
        step = KindStep(copy, perf, target_cfg, LAYER_IDS, 1, seq_len, zero3=False)
        with OpCounter() as counter:
            step()
        return counter.ops

    small, large = [ops(n) for n in SCALE_POINTS]
    assert large > small  # the work grows in it
    assert at_scale([small, large], 128) == pytest.approx(ops(128), rel=0.02)


# ---- a new kind is a folder and a registry entry ---------------------------------------------
# A kind of its own name, fields, preset, backend and engine format (Eagle3's model and loss
# under another architecture), added to a copy of the package as a real kind is: its folder and
# one entry in registry.py, nothing else.
TOY_FILES = {
    "__init__.py": "",
    "config.py": '''
from dataclasses import dataclass

from dspark_ds.drafters.common.registration import Capabilities, Preset, Registration
from dspark_ds.drafters.toy import serving


@dataclass
class ToyFields:
    toy_depth: int = 2
    """Toy: a field of its own."""

    def check_fields(self, check):
        check.at_least_1("ttt_length", "toy_depth")


@dataclass
class ToySizes:
    ttt_length: int = 7
    """Toy: its size of its own."""


REGISTRATION = Registration(
    name="toy",
    fields=ToyFields,
    kind_class="dspark_ds.drafters.toy.kind:Toy",
    presets={"toy": Preset(label="Toy", fields={"num_draft_layers": 1, "toy_depth": 3},
                           sized=lambda s: {"ttt_length": s.ttt_length})},
    sizes=ToySizes,
    backends={"Qwen3ToyModel": ("dspark_ds.drafters.toy.model", "Qwen3ToyModel",
                                "transformers.models.qwen3.configuration_qwen3:Qwen3Config")},
    architectures={},
    generic_architecture="Qwen3ToyModel",
    serving=serving,
    capabilities=Capabilities(
        label="Toy", drafting="unrolled", uses_mask_token=False, anchor_blocks=False,
        heads=(), block_layouts=(), loss_impls=("auto", "reference", "chunked"),
        attn_impls=("auto", "dense"), bench_variants=("dense/reference",),
    ),
)
''',
    "model.py": """
from dspark_ds.drafters.eagle3.qwen3 import Qwen3Eagle3Model


class Qwen3ToyModel(Qwen3Eagle3Model):
    architecture = "Qwen3ToyModel"
""",
    "serving.py": """
ARCHITECTURES = READS = ("Qwen3ToyModel",)


def engine_dict(data):
    return data


def native_dict(data, target_config=None):
    return data
""",
    "kind.py": """
from dspark_ds.drafters import io
from dspark_ds.drafters.eagle3.kind import Eagle3, Eagle3Report, Eagle3Train
from dspark_ds.drafters.toy.config import REGISTRATION
from dspark_ds.drafters.toy.model import Qwen3ToyModel


class ToyReport(Eagle3Report):
    def tags(self, config):
        return {"toy_depth": config.toy_depth}


class Toy(Eagle3):  # Eagle3's decoding round and cost terms; its own data, training, report
    registration, model_class = REGISTRATION, Qwen3ToyModel
    train, report = Eagle3Train(REGISTRATION), ToyReport()

    def build_config(self, target_config, model, *, target_layer_ids, **_):
        cfg, text = io.draft_config_from_target(
            target_config, self.name, target_layer_ids, model.num_draft_layers
        )
        cfg.draft_num_hidden_layers = model.num_draft_layers
        cfg.ttt_length, cfg.step_loss_decay = model.ttt_length, model.step_loss_decay
        cfg.toy_depth = model.toy_depth
        return io.finalize_draft_config(cfg, text)
""",
}


@pytest.fixture
def package_with_a_toy_kind(tmp_path):
    """A copy of the package with drafters/toy/ and its registry entry, imported in place of
    the package (the package's modules are put back after)."""
    import importlib
    import shutil
    import sys
    from pathlib import Path

    import dspark_ds

    src = Path(dspark_ds.__file__).parent
    copy = tmp_path / "dspark_ds"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__", "datasets"))
    toy = copy / "drafters" / "toy"
    toy.mkdir()
    for name, text in TOY_FILES.items():
        (toy / name).write_text(text.lstrip())
    registry = copy / "drafters" / "registry.py"
    text = registry.read_text()
    entry = "(dspark.REGISTRATION, eagle3.REGISTRATION)"
    assert entry in text
    text = text.replace(entry, "(dspark.REGISTRATION, eagle3.REGISTRATION, toy.REGISTRATION)")
    text = text.replace(
        "from dspark_ds.errors import ConfigError",
        "from dspark_ds.drafters.toy import config as toy\nfrom dspark_ds.errors import ConfigError",
    )
    registry.write_text(text)
    ours = {n: m for n, m in sys.modules.items() if n.split(".")[0] == "dspark_ds"}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield copy
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.split(".")[0] == "dspark_ds"]:
            del sys.modules[name]
        sys.modules.update(ours)


def test_a_new_kind_is_a_folder_and_a_registry_entry(package_with_a_toy_kind, tmp_path):
    from dspark_ds.cli import parse_config
    from dspark_ds.cost.inventory import inventory
    from dspark_ds.drafters.io import build_draft_model, load_draft_model, save_draft_model
    from dspark_ds.drafters.presets import PRESETS, DrafterSizes, preset
    from dspark_ds.drafters.registry import REGISTERED, get_kind, kind_of
    from dspark_ds.errors import ConfigError
    from dspark_ds.perf.bench_variant import run_variant
    from dspark_ds.perf.train_bench import TrainBenchConfig
    from dspark_ds.tune import TunerConfig
    from dspark_ds.tune.config import load_recipe
    from dspark_ds.tune.workload import host_work

    from helpers.drafters import tiny_qwen3_config

    assert get_kind("toy").__module__.startswith("dspark_ds.drafters.toy")
    # what it can do: its registration's data, the same its kind serves
    kind = get_kind("toy")
    assert kind.capabilities is REGISTERED["toy"].capabilities and kind.name == "toy"
    assert (kind.capabilities.label, kind.capabilities.drafting) == ("Toy", "unrolled")
    # the `model` section and the CLI: its field, its checks
    recipe = str(package_with_a_toy_kind / "recipes" / "eagle3_qwen3_8b.yaml")
    cfg = parse_config(
        "train", ["--config", recipe, "--model.kind", "toy", "--model.toy_depth", "5"]
    )
    assert (cfg.model.kind, cfg.model.toy_depth, cfg.model.ttt_length) == ("toy", 5, 7)
    with pytest.raises(ConfigError, match="model.toy_depth"):
        replace(cfg.model, toy_depth=0).validate()
    # a perf path its capabilities do not list is refused by name
    with pytest.raises(ConfigError, match="perf.attn_implementation: 'flex' .* toy"):
        parse_config("train", ["--config", recipe, "--model.kind", "toy"] + FLEX).validate()
    # its preset, its backend, its directory read back as its kind
    assert PRESETS["toy"].label == "Toy" and preset("toy").toy_depth == 3
    draft = kind.build_config(tiny_qwen3_config(), preset("toy"), target_layer_ids=[0, 1])
    model = build_draft_model(draft)
    assert type(model).__name__ == "Qwen3ToyModel" and kind_of(model) is kind
    loaded = load_draft_model(save_draft_model(model, tmp_path / "toy"))
    assert kind_of(loaded) is kind and kind.report.tags(loaded.config) == {"toy_depth": 3}
    assert kind.decode.tokens_per_round(loaded.config) == 7  # its ttt_length, as Eagle3's
    # the tuner: its step shape and its host-work copies
    run_cfg = load_recipe(TunerConfig(recipe=recipe, overrides=["--model.kind", "toy"]))
    assert inventory(run_cfg).step_shape(run_cfg).drafter == kind.cost.step_part(run_cfg.model)
    assert host_work(run_cfg, (0,), "cuda", timed=False)["ops"]["drafter"][0] > 0
    # the bench: its variants, its step
    bench = TrainBenchConfig(
        drafter="toy",
        hidden_size=32,
        intermediate_size=64,
        vocab_size=64,
        num_target_layers=2,
        seq_len=24,
        sizes=DrafterSizes.with_block("toy", ttt_length=3),
        repeats=1,
        matmul_size=32,
        num_threads=0,
    )
    assert bench.variants == ["dense/reference"]
    result = run_variant(bench, "dense/reference")
    assert result["loss_first_step"] > 0 and result["flops_per_step"] > 0


FLEX = ["--perf.attn_implementation", "flex", "--target.path", "t"]


@contextlib.contextmanager
def in_this_process():
    """A subcommand run in the test's process: the one-process group it makes and the
    environment it sets are undone after."""
    env = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)


def test_a_new_kind_trains_exports_and_evaluates(package_with_a_toy_kind, tmp_path, tiny_target):
    """The toy kind through `dspark-ds train` (two steps, DeepSpeed on CPU), `dspark-ds export`
    and `dspark-ds eval`: nothing outside its folder and its registry entry knows it."""
    from transformers import AutoModelForCausalLM

    from dspark_ds.cli import main
    from dspark_ds.drafters.io import load_draft_model
    from dspark_ds.drafters.registry import get_kind, kind_of
    from dspark_ds.eval.decoding import speculative_generate, target_generate

    recipe = str(package_with_a_toy_kind / "recipes" / "eagle3_tiny_cpu.yaml")
    argv = ["train", "--config", recipe, "--model.kind", "toy", "--model.toy_depth", "4"]
    argv += ["--target.path", tiny_target, "--target.layer_ids", "[0, 1, 2]"]
    argv += ["--output_dir", str(tmp_path / "runs"), "--train.max_steps", "2"]
    argv += ["--train.synthetic_samples", "8", "--data.max_length", "32"]
    argv += ["--checkpoint.every_steps", "2", "--validation.every_steps", "0"]
    argv += ["--train.progress_bar", "false", "--tracking.enabled", "false"]
    with in_this_process():
        assert main(argv) == 0
    run = tmp_path / "runs" / "eagle3_tiny_cpu"
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in log)

    # `dspark-ds export` of the last checkpoint: the live export's weights, read back as its kind
    assert main(["export", "--checkpoint", str(run), "--output_dir", str(tmp_path / "out")]) == 0
    live, exported = load_draft_model(run / "export"), load_draft_model(tmp_path / "out")
    kind = get_kind("toy")
    assert kind_of(exported) is kind and exported.config.toy_depth == 4
    for name, tensor in live.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, msg=name)

    # greedy speculative decoding with it is the target's greedy decoding
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    out, stats = speculative_generate(target, exported, ids, max_new_tokens=16, temperature=0.0)
    assert torch.equal(out, target_generate(target, ids, max_new_tokens=16, temperature=0.0))
    assert stats.rounds >= 1 and max(stats.proposed_per_round) <= 4  # its ttt_length

    # `dspark-ds eval`: a round sized by the kind, no calibration (it has no confidence head)
    (tmp_path / "prompts.jsonl").write_text('{"turns": ["What is 2 + 3?"]}\n')
    payload = cpu_eval(
        tiny_target,
        tmp_path / "out",
        tmp_path / "eval",
        benchmarks=["prompts"],
        data_dir=str(tmp_path),
        max_samples=1,
        max_new_tokens=8,
    )
    (row,) = payload["benchmarks"]
    assert row["num_prompts"] == 1 and len(row["accept_rate_by_position"]) == 4
    assert not payload["calibration"]
