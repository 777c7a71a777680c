"""The Slurm launcher: an sbatch job for a topology recipe, and the sweep as an array job (pure).

`sbatch_script` writes one job of N nodes, one task per node (`srun --kill-on-bad-exit=1`, so
any task's exit ends every task: the set supervisor's rule, enforced by Slurm), each task running
`m3patch serve RECIPE --role R --rank K --run-dir RUN` for the node its SLURM_PROCID maps to,
with its own log (`RUN/logs/task-%t.out`). The head's address is the first node of the
allocation. A site hook (`M3PATCH_SITE_HOOK`, sourced if set) wraps the container runtime:
it may define `m3patch_exec` (e.g. `srun --container-image=...` pyxis arguments or
`apptainer exec`). The sweep runs from the batch step once the head's record says ready.
`sweep_array_script` fans the sweep out as one array task per cell against a running set.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from m3patch.cluster.node_plan import require_topology
from m3patch.recipe.loader import Recipe

SITE_HOOK_VAR = "M3PATCH_SITE_HOOK"


def task_table(recipe: Recipe) -> list[tuple[str, int]]:
    """(role, rank) for SLURM_PROCID 0, 1, ...: launch order, the head last."""
    return [(n.role, n.rank) for n in require_topology(recipe).nodes()]


def sbatch_script(recipe: Recipe, run_dir: Path, *, partition: str | None = None,
                  time_limit: str = "02:00:00", sweep: bool = True) -> str:
    topo = require_topology(recipe)
    table = task_table(recipe)
    head = topo.head
    roles = " ".join(f"{role}:{rank}" for role, rank in table)
    recipe_arg, run_arg = shlex.quote(str(recipe.path)), shlex.quote(str(run_dir))
    part = f"#SBATCH --partition={partition}\n" if partition else ""
    return f"""#!/bin/bash
#SBATCH --job-name=m3patch-{recipe.name}
#SBATCH --nodes={len(table)}
#SBATCH --ntasks-per-node=1
#SBATCH --time={time_limit}
#SBATCH --output={run_dir}/logs/batch-%j.out
{part}# Written by m3patch for recipe {recipe.path}: one task per node of its topology.
set -euo pipefail
RUN={run_arg}
RECIPE={recipe_arg}
mkdir -p "$RUN/logs"
# Site hook: define m3patch_exec to wrap the container runtime (pyxis, apptainer, ...).
m3patch_exec() {{ "$@"; }}
if [ -n "${{{SITE_HOOK_VAR}:-}}" ]; then source "${{{SITE_HOOK_VAR}}}"; fi
# The DP head runs as the last task, on the last host of the allocation (block distribution).
HEAD_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n {len(table)}p)
export M3PATCH_HEAD_ADDR="${{M3PATCH_HEAD_ADDR:-$HEAD_HOST}}"
# SLURM_PROCID -> role:rank ({roles}); the head ({head}) is the last task.
cat > "$RUN/tasks.sh" <<'TASKS'
#!/bin/bash
set -euo pipefail
roles=({roles})
pair=${{roles[$SLURM_PROCID]}}
exec $M3PATCH_CMD serve "$RECIPE" --role "${{pair%%:*}}" --rank "${{pair##*:}}" --run-dir "$RUN" --quiet
TASKS
chmod +x "$RUN/tasks.sh"
M3PATCH_CMD="${{M3PATCH_CMD:-m3patch}}"   # e.g. "python -m m3patch" in a checkout
export RUN RECIPE M3PATCH_CMD
# --kill-on-bad-exit: one task's failure ends every task (no orphaned headless node).
m3patch_exec srun --kill-on-bad-exit=1 --ntasks={len(table)} --ntasks-per-node=1 \\
  --output="$RUN/logs/task-%t.out" "$RUN/tasks.sh" &
SET=$!
{_sweep(head.slug, recipe.port) if sweep else 'wait "$SET"'}
"""


def _sweep(head_slug: str, port: int) -> str:
    return f"""# The sweep runs from the batch step once the head's rendezvous record says ready.
until grep -q '"state": "ready"' "$RUN/nodes/{head_slug}.json" 2>/dev/null; do
  kill -0 "$SET" 2>/dev/null || {{ wait "$SET"; exit $?; }}
  sleep 5
done
$M3PATCH_CMD bench "$RECIPE" --url "http://$M3PATCH_HEAD_ADDR:{port}" --run-dir "$RUN/bench"
# SIGTERM: srun forwards it to every task, whose runner stops its server through the stop ladder
# (srun's manual: a single SIGINT only makes it print the tasks' states).
kill -TERM "$SET"; wait "$SET" || true"""


def sweep_array_script(recipe: Recipe, run_dir: Path, cell_ids: list[str], url: str) -> str:
    """One array task per sweep cell against a running set (`m3patch bench --only CELL`), every
    task writing its cell file into the same run folder.

    The tasks run one at a time (`%1`): cells sharing one set would load it together and skew
    each other's numbers. A task's aggregate.json covers only its own cell (bench aggregates its
    plan's cells), so the last task then aggregates the whole sweep (`bench --resume` without
    --only: finished cells are kept, a missing one is measured), as a local run's."""
    ids = " ".join(shlex.quote(c) for c in cell_ids)
    last = len(cell_ids) - 1
    bench = (f"${{M3PATCH_CMD:-m3patch}} bench {shlex.quote(str(recipe.path))} --url "
             f"{shlex.quote(url)} --run-dir {shlex.quote(str(run_dir))}/bench --resume")
    return f"""#!/bin/bash
#SBATCH --job-name=m3patch-{recipe.name}-sweep
#SBATCH --array=0-{last}%1
#SBATCH --ntasks=1
#SBATCH --output={run_dir}/logs/cell-%a.out
set -euo pipefail
cells=({ids})
{bench} --only "${{cells[$SLURM_ARRAY_TASK_ID]}}"
if [ "$SLURM_ARRAY_TASK_ID" -eq {last} ]; then
  {bench}
fi
"""
