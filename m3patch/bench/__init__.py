"""Concurrency sweeps with vLLM's own `vllm bench serve`: cells, client, results, compare, plots, matrix."""
