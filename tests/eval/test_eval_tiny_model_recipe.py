"""The tiny model's training recipe (scripts/setup/make_tiny_model.py), without training it: the
cache key follows every setting and every line of code that decides the weights, and the
learning-rate schedule holds its peak until the answer loss has left the carry plateau."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup" / "make_tiny_model.py"


@pytest.fixture
def trainer() -> Iterator[ModuleType]:
    """A fresh copy of the script's module per test (tests change its settings)."""
    spec = importlib.util.spec_from_file_location("make_tiny_model_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_cache_key_follows_settings_seed_and_code(trainer: ModuleType) -> None:
    key = trainer.recipe_id(0)
    assert key.startswith("tiny-arith-v2 seed=0 sha256=") and trainer.recipe_id(0) == key
    assert trainer.recipe_id(1) != key
    trainer.TRAIN["lr"] *= 2
    assert trainer.recipe_id(0) != key
    trainer.TRAIN["lr"] /= 2
    assert trainer.recipe_id(0) == key
    # a changed line in the training loop is a new recipe, though no setting moved

    def train(vocab: object, seed: int) -> None:  # a stand-in with other code
        del vocab, seed

    trainer.train = train
    assert trainer.recipe_id(0) != key


def test_a_model_made_by_another_recipe_is_not_reused(trainer: ModuleType, tmp_path: Path) -> None:
    assert not trainer.built_here(tmp_path, 0)
    (tmp_path / trainer.DONE_MARK).write_text("tiny-arith-v1 seed=0 sha256=8ec80b02ba0380ea steps=400\n")
    assert not trainer.built_here(tmp_path, 0)  # the earlier release's model: trained again
    (tmp_path / trainer.DONE_MARK).write_text(trainer.recipe_id(0) + " steps=1\n")
    assert trainer.built_here(tmp_path, 0) and not trainer.built_here(tmp_path, 1)


def _run(trainer: ModuleType, losses: Iterator[float]) -> list[float]:
    schedule, rates, loss = trainer.Schedule(), [], 5.0
    step = 0
    while (lr := schedule.lr(step, loss)) is not None:
        rates.append(lr)
        loss = next(losses)
        step += 1
    return rates


def test_the_schedule_holds_the_peak_until_the_loss_falls_then_decays(trainer: ModuleType) -> None:
    train = trainer.TRAIN
    train.update(lr=1.0, warmup=4, converged=0.05, decay=10, steps=1000)
    plateau_then_drop = iter([0.6] * 96 + [0.001] * 10_000)
    rates = _run(trainer, plateau_then_drop)
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]
    held = [r for r in rates if r == 1.0]
    assert len(held) > 96  # the peak outlasts the plateau: leaving it late is not cut short
    tail = rates[len(rates) - 10:]
    assert tail == sorted(tail, reverse=True) and tail[-1] > 0 and len(rates) < 200


def test_the_schedule_stops_by_its_step_cap_on_a_plateau_it_never_leaves(trainer: ModuleType) -> None:
    trainer.TRAIN.update(lr=1.0, warmup=4, converged=0.05, decay=10, steps=50)
    rates = _run(trainer, iter([0.6] * 10_000))
    assert len(rates) == 50 + 10 and rates[49] == 1.0 and rates[-1] == pytest.approx(0.1)
