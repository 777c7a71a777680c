"""Run by the target interpreter (its transformers and numpy; never imported by m3patch):
one cell's chat-template prompts, counted the way InferenceX counts them.

InferenceX's speculative-decoding runs pass `--use-chat-template` to its client: the stated ISL
includes the chat template. The template's own tokens (those of a one-token message, less that
token) come off the stated ISL; each prompt body is drawn in the cell's length range around the
rest, made of exactly that many tokens, and written as a `vllm bench serve --dataset-name custom`
line. vLLM's client applies the template to each body and counts the result, so the input it
reports (and sends, as a completions prompt) is the templated prompt, as InferenceX's is.

argv: TOKENIZER ISL OSL RATIO CONVENTION NUM SEED OUT. Prints one JSON line (prefix
`M3PATCH_CHAT_PROMPTS: `) with the template overhead and the drawn lengths.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any


def _lengths(rng: Any, total: int, ratio: float, convention: str, num: int) -> list[int]:
    """Uniform integer lengths: InferenceX's [int(L*r), L] or vLLM's [L(1-r), L(1+r)]."""
    if convention == "inferencex":
        low, high = int(total * ratio), total
    else:
        low, high = math.floor(total * (1 - ratio)), math.ceil(total * (1 + ratio))
    return [int(v) for v in rng.integers(max(low, 1), max(high, 1) + 1, size=num)]


def _body(tokenizer: Any, rng: Any, length: int, allowed: Any) -> str:
    """Text that the tokenizer encodes (without special tokens) to exactly `length` tokens:
    random tokens, re-encoded and trimmed or topped up until the count holds; a draw that does
    not settle is replaced by a fresh one."""
    for _ in range(32):
        ids = [int(v) for v in rng.choice(allowed, size=length)]
        for _ in range(16):
            text = tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == length:
                return str(text)
            ids = ids[:length] + [int(v) for v in
                                  rng.choice(allowed, size=max(0, length - len(ids)))]
    msg = f"could not make a {length}-token prompt body with this tokenizer"
    raise SystemExit(msg)


def _stable(tokenizer: Any, np: Any) -> Any:
    """Content tokens that encode back to themselves alone (no special tokens, no byte pieces
    that only merge with a neighbour): the bodies settle in a step or two."""
    specials = set(tokenizer.all_special_ids)
    ids = [i for i in range(min(tokenizer.vocab_size, len(tokenizer))) if i not in specials]
    texts = tokenizer.batch_decode([[i] for i in ids])
    again = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return np.array([i for i, back in zip(ids, again, strict=True) if back == [i]])


def main() -> None:
    import numpy as np  # the target interpreter's, as vLLM's client uses it
    from transformers import AutoTokenizer  # type: ignore[import-not-found]

    name, isl, osl, ratio, convention, num, seed, out = sys.argv[1:9]
    tokenizer = AutoTokenizer.from_pretrained(name)
    if not getattr(tokenizer, "chat_template", None):
        msg = f"the tokenizer of {name} has no chat template"
        raise SystemExit(msg)
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "a"}],
                                          add_generation_prompt=True, tokenize=False)
    overhead = len(tokenizer.encode(probe, add_special_tokens=False)) - 1
    body = int(isl) - overhead
    if body < 1:
        msg = f"isl {isl} leaves no room beside the chat template's {overhead} tokens"
        raise SystemExit(msg)
    rng = np.random.default_rng(int(seed))
    inputs = _lengths(rng, body, float(ratio), convention, int(num))
    outputs = _lengths(rng, int(osl), float(ratio), convention, int(num))
    # Content tokens only: a special token in a body would be read as chat framing.
    allowed = _stable(tokenizer, np)
    counted = []
    with open(out, "w", encoding="utf-8") as handle:
        for length, output in zip(inputs, outputs, strict=True):
            text = _body(tokenizer, rng, length, allowed)
            handle.write(json.dumps({"prompt": text, "output_tokens": output}) + "\n")
            # InferenceX's count of the prompt as sent: templated, without special tokens added.
            sent = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
            counted.append(len(tokenizer.encode(sent, add_special_tokens=False)))
    print("M3PATCH_CHAT_PROMPTS: " + json.dumps(
        {"template_tokens": overhead, "input_lens": inputs, "output_lens": outputs,
         "templated_lens": counted}))


if __name__ == "__main__":
    main()
