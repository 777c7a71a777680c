"""One `m3patch tune` run (precompile, tune every shape, write tables) or `tune --check` (judge
every entry of a table against vLLM's default). The effects live here.

Imports torch/triton (through runner) at module level: only the tune command imports this,
and only inside `run()`.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from m3patch.errors import BenchFailed, RunDeadline, UsageError
from m3patch.fsio import write_output_json
from m3patch.output import info
from m3patch.tune import compile_pool
from m3patch.tune.cache import ResultCache
from m3patch.tune.judge import Judgement, measure
from m3patch.tune.kernel_source import KernelSource, load_kernel
from m3patch.tune.kernel_timer import ConfigFailed, MoEBench
from m3patch.tune.naming import default_config, table_file_name
from m3patch.tune.routing import Routing
from m3patch.tune.shapes import MoEShape
from m3patch.tune.space import SpaceAxes, TileConfig, space_for_shape
from m3patch.tune.table_check import report, table_entries
from m3patch.tune.tile import launches_needed
from m3patch.tune.tuner import BatchBest, Progress, TuneOptions, tune_shape
from m3patch.tune.writer import Provenance, SearchRecord, nearest_config, write_table


@dataclass(frozen=True)
class TuneSpec:
    shapes: tuple[MoEShape, ...]
    batches: tuple[int, ...]
    axes: SpaceAxes
    out_dir: Path
    cache_path: Path
    vllm_source: Path | None
    workers: int
    options: TuneOptions
    device_name: str | None
    command: str
    precompile: bool = True
    routing: Routing = field(default_factory=Routing)


@dataclass(frozen=True)
class CheckSpec:
    table: Path
    shape: MoEShape
    json_path: Path
    vllm_source: Path | None
    workers: int
    rounds: int
    reps: int
    batches: tuple[int, ...] | None  # None: the table's own batch sizes
    command: str
    routing: Routing = field(default_factory=Routing)


def driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown"
    proc = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False, timeout=30)
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout else "unknown"


def _require_gpu() -> None:
    if not torch.cuda.is_available():
        msg = "m3patch tune needs a CUDA GPU (torch.cuda.is_available() is False)"
        raise UsageError(msg, hint="run it on the GPU machine the table is for")


def _on_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def _precompile(spec: TuneSpec, plans: list[dict[int, list[TileConfig]]],
                cache: ResultCache) -> None:
    """Failures are only logged: the timing pass re-checks every config and records them."""
    rocm = _on_rocm()
    jobs = []
    for shape, plan in zip(spec.shapes, plans, strict=True):
        defaults = {batch: default_config(shape, batch, rocm=rocm) for batch in plan}
        needed = launches_needed(cache, spec.routing.for_shape(shape).cache_key(shape), plan, spec.options.refine_top, defaults)
        jobs += list(compile_pool.make_jobs(shape, needed, chunk=8))
    total = sum(len(job[2]) for job in jobs)
    progress = Progress(total, "compile")
    started = time.monotonic()
    with progress.running():
        failures = compile_pool.precompile(jobs, workers=spec.workers,
                                           vllm_source=spec.vllm_source,
                                           on_done=progress.advance)
    info(f"precompiled {total} (config, batch) launches in {time.monotonic() - started:.0f} s "
         f"with {spec.workers} workers; {len(failures)} failed")


def _provenance(spec: TuneSpec, source: KernelSource, shape: MoEShape,
                best: dict[int, BatchBest], plan: dict[int, list[TileConfig]]) -> Provenance:
    rocm = _on_rocm()
    search = {b: SearchRecord(len(plan[b]), r.timed, r.resumed, r.failed,
                              default_config(shape, b, rocm=rocm).key, r.default_us)
              for b, r in best.items()}
    return Provenance(
        device=torch.cuda.get_device_name(), driver=driver_version(),
        torch=torch.__version__, triton=triton.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        command=spec.command, kernel_origin=source.origin, kernel_sha256=source.source_sha256,
        shape=shape.key, timings_us={b: r.us for b, r in best.items()},
        expert_parallel=shape.expert_parallel, search=search,
        judged={b: r.judgement for b, r in best.items() if r.judgement is not None},
        routing=spec.routing.for_shape(shape).describe(shape))


def run_tune(spec: TuneSpec) -> list[Path]:
    _require_gpu()
    source = load_kernel(spec.vllm_source)
    rocm = _on_rocm()
    plans = [space_for_shape(shape, spec.batches, spec.axes, rocm=rocm) for shape in spec.shapes]
    cache = ResultCache(spec.cache_path)
    if spec.precompile and spec.workers > 0:
        _precompile(spec, plans, cache)
    written: list[Path] = []
    unfinished: list[str] = []
    device = spec.device_name or torch.cuda.get_device_name()
    for shape, plan in zip(spec.shapes, plans, strict=True):
        bench = MoEBench(source.kernel, shape, routing=spec.routing.for_shape(shape))
        progress = Progress(sum(len(c) for c in plan.values()), f"tune {shape.key}")
        with progress.running():
            best = tune_shape(bench, plan, cache, spec.options, progress, rocm=rocm)
        del bench
        torch.cuda.empty_cache()
        missing = [b for b in plan if b not in best]
        if missing:
            unfinished.append(f"{shape.key}: batch sizes {missing}")
            continue
        path = write_table(spec.out_dir, table_file_name(shape, device),
                           {b: r.config for b, r in best.items()},
                           _provenance(spec, source, shape, best, plan))
        info(f"wrote {path}")
        written.append(path)
    if unfinished:
        msg = "tuning stopped before finishing " + "; ".join(unfinished)
        raise RunDeadline(msg, hint=f"re-run the same command: finished results resume from "
                                    f"{spec.cache_path}")
    return written


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _precompile_pairs(spec: CheckSpec, pairs: dict[int, tuple[TileConfig, TileConfig]]) -> None:
    plan = {b: sorted(set(pair)) for b, pair in pairs.items()}
    jobs = list(compile_pool.make_jobs(spec.shape, plan, chunk=2))
    started = time.monotonic()
    failures = compile_pool.precompile(jobs, workers=spec.workers, vllm_source=spec.vllm_source,
                                       on_done=lambda _n: None)
    info(f"precompiled {sum(len(job[2]) for job in jobs)} launches in "
         f"{time.monotonic() - started:.0f} s; {len(failures)} failed (judged below)")


def run_check(spec: CheckSpec) -> list[Judgement]:
    """Judge every entry of spec.table against vLLM's default on this GPU; write the JSON."""
    _require_gpu()
    entries = table_entries(spec.table)
    source = load_kernel(spec.vllm_source)
    rocm = _on_rocm()
    batches = spec.batches or tuple(sorted(entries))
    pairs = {b: (nearest_config(entries, b), default_config(spec.shape, b, rocm=rocm))
             for b in batches}
    if spec.workers > 0:
        _precompile_pairs(spec, pairs)
    routing = spec.routing.for_shape(spec.shape)
    bench = MoEBench(source.kernel, spec.shape, routing=routing)
    judgements = []
    for batch, (entry, default) in pairs.items():
        try:
            verdict = measure(bench, batch, entry, default, rounds=spec.rounds, reps=spec.reps)
        except ConfigFailed as exc:
            msg = f"{spec.table}: entry for M={batch} cannot run here: {exc}"
            raise BenchFailed(msg, hint="re-tune on this GPU with `m3patch tune`") from None
        info(f"M={batch}: {verdict.verdict} (t/d {verdict.ratio:.3f}, noise "
             f"{100 * verdict.noise:.1f}%)")
        judgements.append(verdict)
    env = {"device": torch.cuda.get_device_name(), "driver": driver_version(),
           "torch": torch.__version__, "triton": triton.__version__, "date": _utc_now(),
           "command": spec.command, "kernel_origin": source.origin,
           "rounds": str(spec.rounds), "reps": str(spec.reps)}
    write_output_json(spec.json_path, report(spec.table, spec.shape, routing.describe(spec.shape),
                                             judgements, env), flag="--json-file")
    return judgements
