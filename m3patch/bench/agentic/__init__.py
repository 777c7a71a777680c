"""The agentic-coding scenario: AIPerf as the client (its own venv), the server's `/metrics`
scraped through each cell, results scored as InferenceX scores them, LMCache's per-rank servers.

`aiperf` (argv, environment, version check: pure but for the probe), `metrics` (Prometheus text,
the scraper), `scoring` (AIPerf's records -> InferenceX's agentic fields, pure), `results` (the
per-cell file: AIPerf's export + provenance), `sweep` (the cells against a ready server),
`lmcache` (per-rank servers: plan pure, start / health / stop).
"""
