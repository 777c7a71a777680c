"""The accuracy gate: lm-evaluation-harness against the served endpoint, judged by the recipe.

scores.py (pure: harness results -> scores -> verdicts), harness.py (argv, pure; the client
subprocess, an effect), datasets.py (cached or not; fetch), runner.py (one eval: every task,
RUN/eval/eval.json, the verdict).
"""
