"""Serving a drafter: the client of an OpenAI-compatible inference server (client.py), the
parity check of `dspark-ds eval --engine.url` (parity.py), and `dspark-ds serve-check`, which
runs vLLM's own config validation and weight loader on a drafter directory (check.py, with
vllm_probe.py run by vLLM's Python). docs/serving.md."""
