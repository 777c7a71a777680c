"""A small version of scripts/measure/crash_soak.py: random SIGKILLs, then 8 concurrent mixed runs.

The full figures (hundreds of kills, 8/16/32 concurrent) come from the script and are published
in docs/reliability.md; this keeps the invariants in CI at a few seconds' cost.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import soak_harness as soak


@pytest.mark.slow
def test_random_sigkills_then_a_clean_run_is_verified(vllm_tree: Path) -> None:
    phase = soak.kills_phase(random.Random(1), vllm_tree, 8)
    assert phase.broken == []
    assert phase.runs == 8 and phase.verified_after == 8
    assert phase.killed >= 2  # the faults really happened


@pytest.mark.slow
def test_eight_concurrent_mixed_runs_with_kills(vllm_tree: Path) -> None:
    phase = soak.Phase()
    soak.concurrency_round(random.Random(2), vllm_tree, 8, phase)
    assert phase.broken == []
    assert phase.killed + phase.survivors_ok == 8 and phase.verified_after == 1


def test_verified_state_tells_the_three_cases_apart(vllm_tree: Path) -> None:
    """The soak's oracle must be able to fail."""
    from core_helpers import replace_file

    assert soak.verified_state(vllm_tree) == "pristine"
    replace_file(vllm_tree / "vllm/logger.py", b"# drifted\n")
    assert soak.verified_state(vllm_tree) is None


def test_a_temp_file_left_by_a_kill_in_atomic_write_is_cleaned(vllm_tree: Path,
                                                                test_series: Path) -> None:
    from m3patch.patching.api import apply_series
    from m3patch.patching.ledger import state_dir
    from m3patch.patching.locate import tree_at
    from m3patch.patching.series import load_series

    state_dir(vllm_tree).mkdir()
    # exactly what SIGKILL after write_new() and before replace() leaves (pid of the dead run)
    (state_dir(vllm_tree) / ".journal.json.tmp999999").write_text('{"phase": "st')
    apply_series(tree_at(vllm_tree), load_series(test_series))
    assert soak.leftovers(vllm_tree) == []
