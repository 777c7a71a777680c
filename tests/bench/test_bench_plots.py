"""Both PNG plots from the recorded real runs, base and new overlaid (matplotlib is in the test extra)."""

from __future__ import annotations

from pathlib import Path

import pytest

from m3patch.bench.aggregate import load_aggregate
from m3patch.bench.plots import INTERACTIVITY_PNG, THROUGHPUT_PNG, PlotRun, draw, run_title
from m3patch.main import main

RUNS = Path(__file__).parents[1] / "data" / "bench" / "runs"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == PNG_MAGIC
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_overlaid_plots_are_written(tmp_path: Path) -> None:
    base, new = load_aggregate(RUNS / "base"), load_aggregate(RUNS / "new")
    assert run_title(base) == "cpu_tiny_moe / vllm-0.32.0 (base)"
    runs = [PlotRun("base", run_title(base), tuple(base["rows"])),
            PlotRun("new", run_title(new), tuple(new["rows"]))]
    paths = draw(runs, tmp_path)
    assert [p.name for p in paths] == [THROUGHPUT_PNG, INTERACTIVITY_PNG]
    for path in paths:
        width, height = _png_size(path)
        assert width > 600 and height > 400


def test_compare_cli_writes_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "compare", str(RUNS / "base"), str(RUNS / "new"),
                 "--plots", str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(
        [THROUGHPUT_PNG, INTERACTIVITY_PNG])
    assert "plot written to" in capsys.readouterr().err
