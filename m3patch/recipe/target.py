"""What to serve: the target (platform, vLLM version, image, interpreter) and the model.

The model section names the weights, the served name, the tokenizer and an optional draft
model; the `speculative` section is parsed here too, because its draft methods take the
draft from `model.draft`. Each parser takes its section's raw mapping (the loader adds the
breadcrumb) and returns a frozen value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from m3patch.recipe.paths import expand, model_source
from m3patch.schema import SchemaError, at_key, check_keys, expect_choice, expect_str

PLATFORMS = ("cpu", "cuda", "rocm-gfx942", "rocm-gfx950")
DRAFT_METHODS = ("eagle", "eagle3", "draft_model")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Target:
    platform: str
    vllm_version: str
    image: str | None
    python: str | None


@dataclass(frozen=True)
class ModelSpec:
    source: str          # what vLLM is given: a local directory or a Hugging Face id
    is_local: bool
    served_name: str
    tokenizer: str       # for the bench client (a local dir avoids a hub lookup)
    draft: str | None
    revision: str | None = None  # a hub model's pinned commit (40 hex); None: whatever `main` is
    # model.source as the recipe writes it (`~`, ${VAR} unexpanded): for output that travels to
    # other machines (the CI matrix); empty when built without a recipe
    source_text: str = ""


def opt_str(data: dict[str, Any], key: str) -> str | None:
    if data.get(key) is None:
        return None
    with at_key(key):
        return expect_str(data[key])


def target(data: dict[str, Any]) -> Target:
    check_keys(data, required=("platform", "vllm-version"), optional=("image", "python"))
    with at_key("platform"):
        platform = expect_choice(data["platform"], PLATFORMS)
    with at_key("vllm-version"):
        version = expect_str(data["vllm-version"])
    python = opt_str(data, "python")
    with at_key("python"):
        python = expand(python) if python else None
    return Target(platform, version, opt_str(data, "image"), python)


def _revision(data: dict[str, Any], is_local: bool) -> str | None:
    """A full commit: a branch or tag can move, and then the same recipe serves other weights."""
    text = opt_str(data, "revision")
    with at_key("revision"):
        if text is not None and not _COMMIT.match(text):
            msg = (f"{text!r} is not a full 40-hex commit (a branch or tag can move; pin the "
                   f"commit its page shows)")
            raise SchemaError(msg)
        if text is not None and is_local:
            msg = "a revision pins a Hugging Face model; model.source is a local folder"
            raise SchemaError(msg)
    return text


def model(data: dict[str, Any]) -> ModelSpec:
    check_keys(data, required=("source", "served-name"),
               optional=("tokenizer", "draft", "revision"))
    with at_key("source"):
        source_text = expect_str(data["source"])
        source, is_local = model_source(source_text)
    with at_key("served-name"):
        served = expect_str(data["served-name"])
    tokenizer = opt_str(data, "tokenizer")
    with at_key("tokenizer"):
        tokenizer = model_source(tokenizer)[0] if tokenizer else source
    draft = opt_str(data, "draft")
    return ModelSpec(source, is_local, served, tokenizer,
                     model_source(draft)[0] if draft else None, _revision(data, is_local),
                     source_text)


def speculative_json(spec: dict[str, Any], draft: str | None) -> str | None:
    """The `--speculative-config` JSON; draft methods get `model.draft` as their model."""
    if not spec:
        if draft is not None:
            msg = "model.draft is set but there is no speculative section to use it"
            raise SchemaError(msg)
        return None
    method = expect_choice(spec.get("method"), ("mtp", *DRAFT_METHODS))
    if method in DRAFT_METHODS:
        if draft is None:
            msg = f"method {method} needs model.draft (the draft model)"
            raise SchemaError(msg)
        if "model" in spec:
            msg = "give the draft model as model.draft, not speculative.model"
            raise SchemaError(msg)
        spec = {"method": method, "model": draft, **{k: v for k, v in spec.items() if k != "method"}}
    return json.dumps(spec, separators=(",", ":"))
