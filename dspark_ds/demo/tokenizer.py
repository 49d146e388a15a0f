"""A byte-level BPE tokenizer trained on the synthetic corpus, shaped like Qwen3's.

Same special tokens and ChatML layout as Qwen3 (`<|im_start|>role\\n...<|im_end|>\\n`),
so the data pipeline treats the demo target exactly like a downloaded one. The chat
template wraps assistant content (and its `<|im_end|>`, so the target learns to stop) in
`{% generation %}` markers: `apply_chat_template(..., return_assistant_tokens_mask=True)`
then marks exactly the tokens a model is trained to produce.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from dspark_ds.data.synthetic import Row
from dspark_ds.errors import ConfigError

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
# NOTE: order fixes the ids: pad 0, <|im_start|> 1, <|im_end|> 2, <|mask|> 3.
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, MASK_TOKEN]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _texts(rows: Sequence[Row]) -> Iterator[str]:
    for row in rows:
        for message in row["messages"]:
            yield message["role"]
            yield message["content"]


def train_tokenizer(rows: Sequence[Row], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on the rows' texts; deterministic for the same rows."""
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ConfigError(
            f"vocab_size: must exceed the 256 byte symbols plus {len(SPECIAL_TOKENS)} special "
            f"tokens, got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    # NOTE: use_regex=True splits words and digit runs before merging (as GPT-2 / Qwen do),
    # so a multi-word name stays several tokens: the choice-dependent continuations the
    # corpus is built around survive tokenization.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # NOTE: trim_offsets=False keeps character offsets exact, which the assistant mask
    # (char_to_token on the `{% generation %}` spans) relies on.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(rows), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        padding_side="right",
    )
