"""Tiny, download-free targets and tokenizers for tests (shared by every test module).

Stable API (other test files rely on it):

- ``build_tiny_tokenizer(out_dir, template="qwen3") -> PreTrainedTokenizerFast``: a byte-level
  BPE tokenizer trained locally on a few strings (any text is encodable, decoding is lossless),
  with ChatML special tokens, ``<|mask|>`` and a chat template, saved with ``save_pretrained``.
  ``template``: ``"qwen3"`` (ChatML, Qwen3 non-thinking logic, ``{% generation %}`` markers),
  ``"qwen3_nomarkers"`` (the same text without markers) or ``"gemma"`` (Gemma-4-style turns, no
  markers).
- ``tiny_widths(vocab_size, **fields) -> dict``: the config fields every tiny target starts from
  (hidden 32, MLP 64, 4 layers, 4 query / 2 KV heads); ``qwen3_target_config(vocab_size, ...)``:
  the ``Qwen3Config`` of a random tiny target at any hidden size.
- ``build_tiny_target(out_dir, ...) -> str``: a random ``Qwen3ForCausalLM`` (hidden 32, 4 layers,
  vocab = the tokenizer's, fp32) plus its tokenizer, saved to ``out_dir``; returns ``out_dir``.
  Loadable with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.
- ``build_tiny_family_target(out_dir, family, seed=0) -> str``: the same for another family
  (``FAMILIES``: llama, qwen2, mistral (tied embeddings), qwen3_moe, gpt_oss, deepseek_v3), from
  ``family_config(family, vocab_size)``.
- ``build_tiny_hybrid_target(out_dir, family, seed=0) -> str``: the same for a hybrid family
  (``HYBRID_FAMILIES``: qwen3_5_text, qwen3_5_moe_text, qwen3_next, granitemoehybrid:
  three linear-attention / Mamba layers then one full-attention layer; falcon_h1: Mamba and
  attention side by side in every layer), from ``hybrid_config(family, vocab_size)``, with the
  lm_head sharpened x8 so that greedy text varies.
- ``write_chat_jsonl(path, n, layout="messages", seed=0)``: ``n`` small conversations;
  ``prepare_chat(root, n, ...)``: the same, tokenised by ``dspark-ds prepare`` into ``root/prep``.
- ``assert_reads_like_from_pretrained(path, state)``: every parameter read tensor by tensor
  from the checkpoint at ``path`` (``TargetWeights``, what ZeRO-3 ranks read their partitions
  from) equals ``state`` (from_pretrained's), any flat range of it too.
- ``QWEN3_TEMPLATE``, ``QWEN3_TEMPLATE_NO_MARKERS``, ``GEMMA_TEMPLATE``: the template strings.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import torch

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|mask|>",
    "<bos>",
    "<|turn>",
    "<turn|>",
    "<think>",
    "</think>",
]

# ChatML with Qwen3's non-thinking behaviour: the assistant turn after the last user query
# carries an (empty) think block, earlier ones do not; the generation prompt adds the empty
# think block when enable_thinking is false. The generation markers wrap content + <|im_end|>.
_QWEN3 = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' or m.role == 'user' -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_query -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "GEN_OPEN{{- m.content + '<|im_end|>' -}}GEN_CLOSE{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)
QWEN3_TEMPLATE = _QWEN3.replace("GEN_OPEN", "{% generation %}").replace(
    "GEN_CLOSE", "{% endgeneration %}"
)
QWEN3_TEMPLATE_NO_MARKERS = _QWEN3.replace("GEN_OPEN", "").replace("GEN_CLOSE", "")

# Gemma-4 style: <bos>, turns delimited by <|turn>role ... <turn|>, assistant role "model", the
# system prompt folded into the first user turn (as Gemma templates do).
GEMMA_TEMPLATE = (
    "{{- '<bos>' -}}"
    "{%- set sys = '' -%}"
    "{%- if messages[0].role == 'system' -%}{%- set sys = messages[0].content + '\\n\\n' -%}"
    "{%- set messages = messages[1:] -%}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
    "{{- '<|turn>' + role + '\\n' + (sys if loop.first else '') + m.content + '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
)

TEMPLATES = {
    "qwen3": QWEN3_TEMPLATE,
    "qwen3_nomarkers": QWEN3_TEMPLATE_NO_MARKERS,
    "gemma": GEMMA_TEMPLATE,
}

_CORPUS = [
    "Hello! How are you today? I am fine, thank you.",
    "What is 2 + 3? The answer is 5.",
    "Write a short poem about the sea and the sky.",
    "The quick brown fox jumps over the lazy dog.",
    "Explain speculative decoding: a small drafter proposes tokens, the target verifies them.",
    "def add(a, b):\n    return a + b\n",
    "You are a helpful assistant. Answer briefly and clearly.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]

_USER = [
    "Hi!",
    "What is 2 + 3?",
    "Tell me a joke.",
    "Name a color.",
    "Count to five.",
    "Write add(a, b) in python.",
    "Why is the sky blue?",
    "Say hello.",
]
_ASSISTANT = [
    "Hello there!",
    "2 + 3 = 5.",
    "Why did the fox jump? To see the dog.",
    "Blue.",
    "1 2 3 4 5",
    "def add(a, b):\n    return a + b",
    "Because of scattering.",
    "Hello!",
]


@functools.cache
def _trained_bpe(vocab_size: int) -> str:
    """The byte-level BPE trained on ``_CORPUS`` (as JSON), once per process and size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


# `dspark-ds demo`'s target section at its smallest (seconds to train): the demo smoke's and the
# peer comparison's
TINY_DEMO_TARGET = """
    --target.num_train_rows 200 --target.vocab_size 320
    --target.hidden_size 32 --target.num_hidden_layers 3
    --target.num_attention_heads 2 --target.num_key_value_heads 1
    --target.intermediate_size 64 --target.max_steps 30 --target.batch_size 8
    --target.lr 1e-2 --target.warmup_steps 2 --target.num_probe_rows 8
    --target.num_threads 1
""".split()
# the same as `DemoTargetConfig` fields (num_threads 1: tiny ops, where 2 threads only add sync
# cost, 10x on a busy machine)
TINY_DEMO_TARGET_FIELDS = {
    flag.removeprefix("--target."): json.loads(value)
    for flag, value in zip(TINY_DEMO_TARGET[::2], TINY_DEMO_TARGET[1::2])
}
# the demo's drafters at their smallest (one DSpark layer, γ 4)
TINY_DEMO_DRAFTERS = """
    --drafter.dspark.num_draft_layers 1 --drafter.dspark.block_size 4
    --drafter.dspark.markov_rank 8 --drafter.eagle3.ttt_length 4
""".split()


def build_tiny_tokenizer(out_dir: str | Path, template: str = "qwen3", vocab_size: int = 384):
    """Train a byte-level BPE on ``_CORPUS`` and save it (with ``template``) to ``out_dir``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_trained_bpe(vocab_size))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|mask|>"],
    )
    fast.chat_template = TEMPLATES[template]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def tiny_widths(vocab_size: int, **fields) -> dict:
    """The config fields every tiny target starts from (hidden 32, MLP 64, 4 layers, 4 query and
    2 KV heads), then `fields`."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **fields,
    }


def qwen3_target_config(
    vocab_size: int,
    *,
    hidden_size: int = 32,
    intermediate_size: int | None = None,
    num_layers: int = 4,
    **fields,
):
    """A random tiny target's ``Qwen3Config``: MLP `intermediate_size` (None = 2 x hidden), 4
    heads of hidden / 4, 2 KV heads, 512 positions, untied embeddings; then `fields`."""
    from transformers import Qwen3Config

    kw = tiny_widths(
        vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        head_dim=hidden_size // 4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return Qwen3Config(**{**kw, **fields})


def special_token_ids(tok) -> dict:
    """The ids a tiny target's config takes from the tiny tokenizer (it has no BOS token)."""
    return {
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": None,
    }


def build_tiny_target(
    out_dir: str | Path,
    *,
    template: str = "qwen3",
    hidden_size: int = 32,
    intermediate_size: int | None = None,
    num_layers: int = 4,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    vocab_size: int | None = None,
) -> str:
    """Save a random tiny ``Qwen3ForCausalLM`` (`qwen3_target_config`) and its tokenizer to
    ``out_dir``; return the path. `vocab_size`: the model's vocabulary, larger than the
    tokenizer's (None = the tokenizer's)."""
    from transformers import Qwen3ForCausalLM

    out_dir = Path(out_dir)
    tok = build_tiny_tokenizer(out_dir, template=template)
    cfg = qwen3_target_config(
        vocab_size or len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        tie_word_embeddings=tie_word_embeddings,
        **special_token_ids(tok),
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(out_dir)
    return str(out_dir)


# DeepSeek's MLA attention and routed + shared experts, tiny (DeepSeek-V3 here, and the MoE
# targets of moe_targets.py built on them)
DEEPSEEK_MLA = dict(
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8
)
DEEPSEEK_MOE = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
# Tiny configs of the target families tested beyond Qwen3 and Gemma4: each keeps what makes
# its family differ (MoE routing and the per-expert checkpoint layout, MLA attention, attention
# sinks with sliding windows, YaRN RoPE, q/k/v biases, tied embeddings).
FAMILIES: dict[str, dict] = {
    "llama": dict(head_dim=8),
    "qwen2": dict(),  # q/k/v biases, no head_dim field
    "mistral": dict(head_dim=8, tie_word_embeddings=True),
    "qwen3_moe": dict(
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    ),
    "gpt_oss": dict(
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    ),
    "deepseek_v3": dict(num_key_value_heads=4, **DEEPSEEK_MOE, **DEEPSEEK_MLA),
}


def family_config(family: str, vocab_size: int, **overrides):
    """A tiny random config of `family` (hidden 32, 4 layers, 4 heads)."""
    from transformers import AutoConfig

    kw = tiny_widths(vocab_size, max_position_embeddings=512, tie_word_embeddings=False)
    kw.update(FAMILIES[family])
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


def build_tiny_family_target(out_dir: str | Path, family: str, *, seed: int = 0) -> str:
    """Save a random tiny causal LM of `family` (fp32) and the tiny tokenizer to `out_dir`."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    tok = build_tiny_tokenizer(out_dir)
    cfg = family_config(family, len(tok), **special_token_ids(tok))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(out_dir)
    return str(out_dir)


# Tiny configs of the hybrid families: layers that keep a recurrent state and a convolution
# state (Gated DeltaNet, Mamba2) beside full attention. Qwen3.5 / Qwen3-Next: partial RoPE
# (transformers' default factor 0.25) and an attention head size of their own.
_HYBRID_LAYERS = ["linear_attention"] * 3 + ["full_attention"]
_DELTANET = dict(
    head_dim=8,
    layer_types=_HYBRID_LAYERS,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_MAMBA = dict(
    mamba_n_heads=4, mamba_d_state=8, mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=16
)
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
HYBRID_FAMILIES: dict[str, dict] = {
    "qwen3_5_text": _DELTANET,
    "qwen3_5_moe_text": {**_DELTANET, **_MOE},
    "qwen3_next": {**_DELTANET, **_MOE},
    "granitemoehybrid": dict(
        layer_types=["mamba"] * 3 + ["attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        **_MAMBA,
    ),
    "falcon_h1": dict(head_dim=8, mamba_d_ssm=64, **_MAMBA),
}
HEAD_SHARPENING = 8.0


def hybrid_config(family: str, vocab_size: int, **overrides):
    """A tiny random config of the hybrid `family` (hidden 32, 4 layers, 4 heads)."""
    from transformers import AutoConfig

    kw = tiny_widths(vocab_size, max_position_embeddings=512, tie_word_embeddings=False)
    kw.update(HYBRID_FAMILIES[family])
    if family == "qwen3_5_moe_text":  # every MLP is a MoE block: no dense width in its config
        kw.pop("intermediate_size")
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


def tiny_hybrid_model(family: str, vocab_size: int, *, seed: int = 0, **overrides):
    """A random tiny hybrid causal LM (fp32, eval) with its lm_head sharpened x8."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hybrid_config(family, vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SHARPENING)
    return model


def build_tiny_hybrid_target(out_dir: str | Path, family: str, *, seed: int = 0) -> str:
    """Save a random tiny hybrid causal LM of `family` and the tiny tokenizer to `out_dir`."""
    out_dir = Path(out_dir)
    tok = build_tiny_tokenizer(out_dir)
    model = tiny_hybrid_model(family, len(tok), seed=seed, **special_token_ids(tok))
    model.save_pretrained(out_dir)
    return str(out_dir)


def chat_rows(n: int, layout: str = "messages", seed: int = 0, system: bool = True) -> list[dict]:
    """``n`` small conversations (1-2 user/assistant turns) in ``layout``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "Be brief."}] if system and rng.random() < 0.5 else []
        for _ in range(rng.choice([1, 1, 2])):
            k = rng.randrange(len(_USER))
            msgs += [
                {"role": "user", "content": _USER[k]},
                {"role": "assistant", "content": _ASSISTANT[k]},
            ]
        if layout == "messages":
            rows.append({"messages": msgs})
        elif layout == "conversations":
            names = {"system": "system", "user": "human", "assistant": "gpt"}
            rows.append(
                {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs]}
            )
        elif layout == "turns":
            rows.append({"turns": [m["content"] for m in msgs if m["role"] == "user"]})
        else:
            raise ValueError(f"unknown layout {layout!r}")
    return rows


def write_chat_jsonl(path: str | Path, n: int, layout: str = "messages", seed: int = 0) -> str:
    """Write ``n`` conversations to ``path`` (one JSON object per line); return the path."""
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(n, layout, seed)))
    return str(path)


def prepare_chat(root: str | Path, n: int, *, seed: int, tokenizer: str, max_length: int) -> Path:
    """``n`` conversations (``write_chat_jsonl``) in ``root/chat.jsonl``, tokenised by
    ``dspark-ds prepare`` into ``root/prep``; returns ``root/prep``."""
    from dspark_ds.data.config import DataConfig, PrepareConfig
    from dspark_ds.data.tokens import prepare

    root = Path(root)
    jsonl = write_chat_jsonl(root / "chat.jsonl", n, seed=seed)
    data = DataConfig(paths=[jsonl], tokenizer=str(tokenizer), max_length=max_length)
    prepare(PrepareConfig(data=data, output_dir=str(root / "prep")))
    return root / "prep"


def assert_reads_like_from_pretrained(path, state: dict[str, torch.Tensor]) -> None:
    """Every parameter of the checkpoint's causal LM class, read tensor by tensor from `path` by
    `TargetWeights` (what each ZeRO-3 rank reads its partitions from; MoE experts fused by
    transformers' converters), equals `state` (from_pretrained's), and so does any flat range
    of it, as a partition reads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dspark_ds.target_checkpoint import causal_lm_config
    from dspark_ds.target_weights import TargetWeights, fill_plan

    model = AutoModelForCausalLM.from_config(causal_lm_config(AutoConfig.from_pretrained(path)))
    seen = set()
    for name, tensor, source in fill_plan(model, TargetWeights(str(path))):
        seen.add(name)
        value = source.read().view(tensor.shape)
        assert torch.equal(value, state[name]), name
        n = value.numel()
        assert torch.equal(source.read(n // 3, n - 1), value.reshape(-1)[n // 3 : n - 1]), name
    assert {n for n, _ in model.named_parameters()} <= seen


def targets_by_family(tmp_path_factory, name: str, build, families) -> dict[str, str]:
    """One tiny target of each of `families`, `build(out_dir, family)` under a folder `name`."""
    root = tmp_path_factory.mktemp(name)
    return {f: build(root / f, f) for f in families}


def assert_taps_are_hidden_states(path):
    """A target of `path` loaded with layers -1, 0, 2, 3 tapped (loading runs check_head): the
    hooks give what output_hidden_states gives (id i = hidden_states[i + 1], a layer's residual
    streams averaged where it keeps several), the last one the final normed state. Returns
    (the target, the ids it ran, output_hidden_states's output) for a family's own checks."""
    from dspark_ds.target import TargetConfig, load_target

    target = load_target(TargetConfig(path=path, layer_ids=[-1, 0, 2, 3], dtype="float32"), "cpu")
    ids = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    hidden, last = target(ids)
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    states = [h.mean(dim=2) if h.dim() == 4 else h for h in out.hidden_states]
    assert torch.equal(hidden, torch.cat([states[i + 1] for i in (-1, 0, 2, 3)], dim=-1))
    assert torch.equal(last, out.hidden_states[4])
    return target, ids, out
