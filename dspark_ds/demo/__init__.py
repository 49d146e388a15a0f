"""Assets of the embedded demo: a locally trained tokenizer and a tiny cached Qwen3 target."""
