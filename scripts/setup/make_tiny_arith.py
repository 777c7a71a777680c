"""Write the shipped local eval task's data: recipes/evals/tiny_arith/tiny_arith.json.

Thirty-two sums of two two-digit numbers with exact integer answers, from a fixed seed, so the file is the
same on every run (the committed copy is what lm-eval reads; rerun only to change the set):

    python3 scripts/setup/make_tiny_arith.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "recipes" / "evals" / "tiny_arith" / "tiny_arith.json"
COUNT = 32
SEED = 20261201


def questions(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def main() -> None:
    OUT.write_text(json.dumps(questions(COUNT, SEED), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {COUNT} questions to {OUT}")


if __name__ == "__main__":
    main()
