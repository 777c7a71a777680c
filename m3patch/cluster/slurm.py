"""The Slurm launcher: an sbatch job for a topology recipe (pure).

`sbatch_script` writes one job of N nodes, one task per node (`srun --kill-on-bad-exit=1`, so
any task's exit ends every task: the set supervisor's rule, enforced by Slurm), each task running
`m3patch serve RECIPE --role R --rank K --run-dir RUN` for the node its SLURM_PROCID maps to,
with its own log (`RUN/logs/task-%t.out`). What a GPU cluster needs is in the job as written:
- resources from the recipe: GPUs per node (local DP x TP of the largest vLLM role, on a GPU
  platform), `--exclusive` there, and the whole node's CPUs for the one task per node (unless
  the caller gives CPUs per task);
- `--time` from the recipe's deadlines (ready + run + the stop), not a fixed guess;
- the set identity: the job id (and restart count), exported to every task;
- srun is the batch step's own background job (`$!` is srun's pid), so the SIGTERM that ends the
  sweep reaches srun, which forwards it to every task;
- the site hook (`M3PATCH_SITE_HOOK`, sourced in the batch step and in every task): it may set
  `M3PATCH_SRUN_ARGS` (e.g. pyxis' `--container-image=...`) and define `m3patch_exec` to wrap a
  command in the site's container runtime (e.g. `apptainer exec IMG`). The node commands and the
  sweep both run through `m3patch_exec`;
- the head's address: M3PATCH_HEAD_ADDR when the site exports it, else the head node's NodeAddr
  (what Slurm itself reaches it at), which the head resolves on itself (and refuses when it is
  not one of its own addresses); the sweep reaches the head at the IP the head published.
The job's output folder (`RUN/logs`) must exist before sbatch: `serve --write-sbatch` creates it.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from m3patch.cluster.node_plan import require_topology
from m3patch.recipe.loader import Recipe

SITE_HOOK_VAR = "M3PATCH_SITE_HOOK"
STOP_MARGIN_S = 600.0  # the stop ladder of every node, the sweep's aggregation, Slurm's KillWait


def task_table(recipe: Recipe) -> list[tuple[str, int]]:
    """(role, rank) for SLURM_PROCID 0, 1, ...: launch order, the head last."""
    return [(n.role, n.rank) for n in require_topology(recipe).nodes()]


def gpus_per_node(recipe: Recipe) -> int:
    """The GPUs the largest vLLM node uses (local DP x TP); 0 on the CPU platform."""
    if recipe.target.platform == "cpu":
        return 0
    topo = require_topology(recipe)
    return max(r.local_dp * recipe.parallelism.tp for r in topo.roles if r.runs_vllm)


def time_limit(recipe: Recipe) -> str:
    """ready + run + stop, whole minutes, as Slurm's H:MM:SS."""
    total = math.ceil((recipe.deadlines.ready_s + recipe.deadlines.run_s + STOP_MARGIN_S) / 60)
    return f"{total // 60}:{total % 60:02d}:00"


def _resources(recipe: Recipe, cpus_per_task: int | None, partition: str | None) -> str:
    gpus = gpus_per_node(recipe)
    lines = [f"#SBATCH --time={time_limit(recipe)}"]
    if gpus:
        lines += [f"#SBATCH --gpus-per-node={gpus}", "#SBATCH --exclusive"]
    if cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    return "\n".join(lines)


def sbatch_script(recipe: Recipe, run_dir: Path, *, partition: str | None = None,
                  cpus_per_task: int | None = None, sweep: bool = True) -> str:
    topo = require_topology(recipe)
    table = task_table(recipe)
    head = topo.head
    roles = " ".join(f"{role}:{rank}" for role, rank in table)
    recipe_arg, run_arg = shlex.quote(str(recipe.path)), shlex.quote(str(run_dir))
    # Without a number, the one task of a node gets every CPU of it (Slurm's default is one).
    cpus = str(cpus_per_task) if cpus_per_task else "$SLURM_CPUS_ON_NODE"
    return f"""#!/bin/bash
#SBATCH --job-name=m3patch-{recipe.name}
#SBATCH --nodes={len(table)}
#SBATCH --ntasks-per-node=1
#SBATCH --output={run_dir}/logs/batch-%j.out
{_resources(recipe, cpus_per_task, partition)}
# Written by m3patch for recipe {recipe.path}: one task per node of its topology.
set -euo pipefail
RUN={run_arg}
RECIPE={recipe_arg}
mkdir -p "$RUN/logs"
M3PATCH_CMD="${{M3PATCH_CMD:-m3patch}}"   # e.g. "python -m m3patch" in a checkout
# One set per job run: a requeued job is a new set, and no record of an earlier run counts.
M3PATCH_SET_ID="${{M3PATCH_SET_ID:-slurm-$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}}}"
# The head runs as the last task, on the last host of the allocation (block distribution).
HEAD_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n {len(table)}p)
# The head's address: the site's, else the NodeAddr Slurm itself reaches that node at (the node
# name may not resolve, or resolve to another interface); the head resolves it on itself.
HEAD_NODEADDR=$(scontrol show node "$HEAD_HOST" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
M3PATCH_HEAD_ADDR="${{M3PATCH_HEAD_ADDR:-${{HEAD_NODEADDR:-$HEAD_HOST}}}}"
M3PATCH_SRUN_ARGS="${{M3PATCH_SRUN_ARGS:-}}"
export RUN RECIPE M3PATCH_CMD M3PATCH_SET_ID M3PATCH_HEAD_ADDR
# Site hook: may set M3PATCH_SRUN_ARGS (pyxis) and define m3patch_exec (apptainer, ...).
m3patch_exec() {{ "$@"; }}
if [ -n "${{{SITE_HOOK_VAR}:-}}" ]; then source "${{{SITE_HOOK_VAR}}}"; fi
# SLURM_PROCID -> role:rank ({roles}); the head ({head}) is the last task.
cat > "$RUN/tasks.sh" <<'TASKS'
#!/bin/bash
set -euo pipefail
roles=({roles})
pair=${{roles[$SLURM_PROCID]}}
m3patch_exec() {{ exec "$@"; }}
if [ -n "${{{SITE_HOOK_VAR}:-}}" ]; then source "${{{SITE_HOOK_VAR}}}"; fi
m3patch_exec $M3PATCH_CMD serve "$RECIPE" --role "${{pair%%:*}}" --rank "${{pair##*:}}" --run-dir "$RUN" --quiet
TASKS
chmod +x "$RUN/tasks.sh"
# --kill-on-bad-exit: one task's failure ends every task (no orphaned headless node). srun is
# this step's own job, so $! is srun's pid and a SIGTERM to it reaches every task.
# shellcheck disable=SC2086
srun $M3PATCH_SRUN_ARGS --kill-on-bad-exit=1 --ntasks={len(table)} --ntasks-per-node=1 \\
  --cpus-per-task={cpus} --output="$RUN/logs/task-%t.out" "$RUN/tasks.sh" &
SET=$!
{_sweep(head.slug, recipe.port) if sweep else 'wait "$SET"'}
"""


def _sweep(head_slug: str, port: int) -> str:
    return f"""# The sweep runs from the batch step once the head's record (this set's) says ready, against
# the IP the head published, inside the site's wrapper.
HEAD_RECORD="$RUN/nodes/$M3PATCH_SET_ID/{head_slug}.json"
until grep -q '"state": "ready"' "$HEAD_RECORD" 2>/dev/null; do
  kill -0 "$SET" 2>/dev/null || {{ wait "$SET"; exit $?; }}
  sleep 5
done
HEAD_IP=$(sed -n 's/.*"address": "\\([^"]*\\)".*/\\1/p' "$HEAD_RECORD")
status=0
m3patch_exec $M3PATCH_CMD bench "$RECIPE" --url "http://$HEAD_IP:{port}" --run-dir "$RUN/bench" || status=$?
# SIGTERM: srun forwards it to every task, whose runner stops its server through the stop ladder
# (srun's manual: a single SIGINT only makes it print the tasks' states).
kill -TERM "$SET"; wait "$SET" || true
exit "$status"
"""
