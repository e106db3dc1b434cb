#!/usr/bin/env python3
"""Train pagedllm's bundled demo model: a small Llama on Tiny Shakespeare, on CPU.

    python scripts/train_demo_model.py --corpus ../shared/data/tinyshakespeare.txt \
        --out pagedllm/assets/shakespeare-llama

What it does:

* Splits the corpus by characters: the first 90 % is the training text, the
  LAST 10 % is held out for validation (never seen by the tokenizer or model).
* Trains a byte-level BPE tokenizer (``tokenizers``: ByteLevel pre-tokenizer and
  decoder, vocabulary <= 4096 including the special tokens ``<s>``, ``</s>``,
  ``<pad>``) on the training text only.
* Trains a ``transformers.LlamaForCausalLM`` (RMSNorm, RoPE, SwiGLU, grouped-query
  attention, tied embeddings) with AdamW and a warmup / constant / linear-decay
  learning-rate schedule, on random 256-token windows of the training token stream. Half of the windows start
  at a speech boundary (after a blank line) and are prefixed with ``<s>``, so the
  model works both with and without a leading BOS. Dropout is applied during
  training only, through forward hooks, so the saved architecture is a plain Llama.
* Reports loss per CHARACTER (total token NLL / number of characters evaluated),
  which is comparable across tokenizers.
* Writes a standard Hugging Face folder (config.json, model.safetensors,
  generation_config.json, tokenizer.json, tokenizer_config.json,
  special_tokens_map.json), a loss curve and a model card (README.md).

Determinism: with ``--steps N`` the run is a pure function of the arguments and the
seed (same machine, thread count and torch version). With ``--minutes`` (the default)
the run fits a wall-clock budget on a loaded machine: it decays the learning rate over
the last ``--decay-frac`` of the time, with a step count fixed from the measured speed
when the decay starts; the log and the card print the resulting ``--steps N
--decay-steps D``, which repeat that run exactly.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time

# Two busy-waiting OpenMP threads on a shared 2-core machine can be several times slower than
# threads that sleep while they wait; must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pagedllm.benchmarks.common import cpu_model  # noqa: E402

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2
USER_NAME = "ROMEO"
ASSISTANT_NAME = "JULIET"
# Renders a conversation as a scene: each message is a speech "NAME:\n<text>\n\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ message['content'] | trim }}{{ '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '" + USER_NAME + ":\\n' }}{{ message['content'] | trim }}{{ '\\n\\n' }}"
    "{% else %}"
    "{{ '" + ASSISTANT_NAME + ":\\n' }}{{ message['content'] | trim }}{{ '\\n\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT_NAME + ":\\n' }}{% endif %}"
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", required=True, help="path to tinyshakespeare.txt")
    p.add_argument("--out", required=True, help="output folder (Hugging Face format)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--minutes", type=float, default=32.0,
                   help="time budget from start to the end of the training loop (tokenizer, compilation, "
                        "periodic evals included); the final evaluation, saving and samples come on top "
                        "(~2-4 min)")
    p.add_argument("--steps", type=int, default=None,
                   help="fixed number of optimizer steps (overrides --minutes; fully deterministic)")
    p.add_argument("--val-frac", type=float, default=0.1)
    # tokenizer
    p.add_argument("--vocab-size", type=int, default=4096)
    # model
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=5)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=None, help="SwiGLU hidden size (default ~8/3 d, multiple of 32)")
    p.add_argument("--max-pos", type=int, default=1024, help="max_position_embeddings in config.json")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    # optimisation
    p.add_argument("--ctx", type=int, default=256, help="training context (tokens)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.02, help="final lr = lr * this")
    p.add_argument("--decay-frac", type=float, default=0.25,
                   help="fraction of the run (time under --minutes, steps under --steps) in the final linear decay")
    p.add_argument("--decay-steps", type=int, default=None,
                   help="with --steps: length of the final linear decay (default round(decay_frac * steps))")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.2,
                   help="training-only dropout on embeddings and on each residual branch")
    p.add_argument("--bos-frac", type=float, default=0.5,
                   help="fraction of training windows that are <s> + text starting at a speech")
    p.add_argument("--evals", type=int, default=16, help="number of periodic validation evaluations")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compile", action="store_true", help="do not torch.compile the training step")
    p.add_argument("--log", default=None, help="optional JSON file for the loss history")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(train_text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([train_text], trainer=trainer)
    # Encoding with add_special_tokens=True prepends <s> (Llama style).
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def speech_start_tokens(text: str, enc) -> torch.Tensor:
    """Token indices at which a speech (text after a blank line) begins."""
    starts = {0}
    i = text.find("\n\n")
    while i != -1:
        j = i + 2
        while j < len(text) and text[j] == "\n":
            j += 1
        if j < len(text):
            starts.add(j)
        i = text.find("\n\n", j)
    idx = [t for t, (a, _) in enumerate(enc.offsets) if a in starts]
    # an offset can repeat only for multi-token characters (not in ASCII text); dedupe anyway
    return torch.tensor(sorted(set(idx)), dtype=torch.long)


# --------------------------------------------------------------------------- model
def build_model(args, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    ffn = args.ffn or int(32 * math.ceil(8 * args.d_model / 3 / 32))
    assert args.d_model % args.n_heads == 0 and args.n_heads % args.n_kv_heads == 0
    assert args.n_kv_heads < args.n_heads, "grouped-query attention wants fewer KV heads than query heads"
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.d_model,
        intermediate_size=ffn,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.d_model // args.n_heads,
        hidden_act="silu",
        max_position_embeddings=args.max_pos,
        rms_norm_eps=1e-5,
        rope_theta=args.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        use_cache=True,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = torch.float32
    model = LlamaForCausalLM(cfg).float()
    return model


def add_training_dropout(model, p: float):
    """GPT-2 style dropout (embeddings + each residual branch), active only in train mode."""
    if p <= 0:
        return []

    def hook(module, inputs, output):
        return F.dropout(output, p, training=module.training)

    inner = model.model
    hs = [inner.embed_tokens.register_forward_hook(hook)]
    for layer in inner.layers:
        hs.append(layer.self_attn.o_proj.register_forward_hook(hook))
        hs.append(layer.mlp.down_proj.register_forward_hook(hook))
    return hs


# --------------------------------------------------------------------------- evaluation
@torch.inference_mode()
def nll_per_char(model, ids: torch.Tensor, n_chars: int, ctx: int, stride: int, batch: int = 16) -> float:
    """Sum of token NLL over the whole stream / n_chars.

    ``ids`` starts with <s> followed by the tokens of the evaluated text, so every
    token of the text is predicted exactly once. Windows of ``ctx`` tokens advance by
    ``stride``; only targets not scored by an earlier window count, so every scored
    token sees at least ctx - stride tokens of context (stride == ctx: plain chunks).
    """
    was_training = model.training
    model.eval()
    L = ids.numel()
    assert L > ctx + 1
    windows = []  # (begin, first scored target index relative to window)
    scored_to = 0  # targets ids[1..scored_to] already scored
    b = 0
    while scored_to < L - 1:
        b = min(b, L - 1 - ctx)
        e = b + ctx  # targets ids[b+1 .. e]
        windows.append((b, scored_to - b))  # relative target index from which to score
        scored_to = e
        b += stride
    total = 0.0
    count = 0
    for k in range(0, len(windows), batch):
        chunk = windows[k:k + batch]
        x = torch.stack([ids[b:b + ctx] for b, _ in chunk])
        y = torch.stack([ids[b + 1:b + ctx + 1] for b, _ in chunk])
        logits = model(input_ids=x).logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none").view(y.shape)
        for r, (_, s) in enumerate(chunk):
            total += nll[r, s:].sum().item()
            count += nll.size(1) - s
    assert count == L - 1, (count, L)
    model.train(was_training)
    return total / n_chars


# --------------------------------------------------------------------------- outputs
def save_tokenizer(tok, out: str, model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=model_max_length, chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    tok.save(os.path.join(out, "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, s in enumerate(SPECIAL_TOKENS)
        },
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)
        f.write("\n")
    return hf


def plot_curve(history, path, chars_per_tok, decay_tokens=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    tr = history["train_fine"] or history["train"]
    ax.plot([h["tokens"] / 1e6 for h in tr], [h["loss_tok"] / chars_per_tok for h in tr],
            lw=0.8, alpha=0.7,
            label="train batches (dropout on), running mean (EMA 0.98), nats/token / train chars per token")
    va = history["val"]
    ax.plot([h["tokens"] / 1e6 for h in va], [h["val_nats_per_char"] for h in va],
            "o-", ms=3, label="validation (last 10 %, exact per char)")
    if decay_tokens is not None:
        ax.axvline(decay_tokens / 1e6, color="gray", lw=0.8, ls=":", label="start of linear LR decay")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("loss (nats per character)")
    lows = [h["loss_tok"] / chars_per_tok for h in tr] + [h["val_nats_per_char"] for h in va]
    ax.set_ylim(bottom=max(0.0, math.floor(10 * min(lows)) / 10 - 0.1),
                top=min(4.0, max(h["val_nats_per_char"] for h in va) + 0.2))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5)
    ax.set_title("shakespeare-llama training")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fmt_sample(text: str) -> str:
    return "\n".join("    " + line for line in text.split("\n"))


# --------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + (argv or sys.argv[1:]))

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tqdm import tqdm

    with open(args.corpus, encoding="utf-8") as f:
        text = f.read()
    split = int(len(text) * (1 - args.val_frac))
    train_text, val_text = text[:split], text[split:]
    print(f"corpus: {len(text):,} chars; train {len(train_text):,} chars, validation (last "
          f"{args.val_frac:.0%}) {len(val_text):,} chars", flush=True)

    tok = train_tokenizer(train_text, args.vocab_size)
    V = tok.get_vocab_size()
    enc = tok.encode(train_text, add_special_tokens=False)
    train_ids = torch.tensor(enc.ids, dtype=torch.long)
    val_ids = torch.tensor(tok.encode(val_text, add_special_tokens=False).ids, dtype=torch.long)
    assert tok.decode(enc.ids) == train_text, "byte-level BPE must round-trip"
    starts = speech_start_tokens(train_text, enc)
    starts = starts[starts < train_ids.numel() - args.ctx]
    train_cpt = len(train_text) / train_ids.numel()
    print(f"tokenizer: vocab {V}; train {train_ids.numel():,} tokens ({train_cpt:.3f} chars/token), "
          f"validation {val_ids.numel():,} tokens ({len(val_text) / val_ids.numel():.3f} chars/token); "
          f"{starts.numel():,} speech starts", flush=True)
    bos = torch.tensor([0], dtype=torch.long)
    val_eval_ids = torch.cat([bos, val_ids])

    model = build_model(args, V)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters ({n_params * 4 / 2**20:.1f} MiB fp32); {model.config.num_hidden_layers} "
          f"layers, d={model.config.hidden_size}, ffn={model.config.intermediate_size}, "
          f"{model.config.num_attention_heads} heads / {model.config.num_key_value_heads} KV heads", flush=True)
    add_training_dropout(model, args.dropout)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    gen = torch.Generator().manual_seed(args.seed)
    n_bos = int(round(args.batch_size * args.bos_frac))
    ctx = args.ctx

    def get_batch():
        rows = []
        if n_bos:
            s = starts[torch.randint(0, starts.numel(), (n_bos,), generator=gen)]
            for i in s.tolist():
                rows.append(torch.cat([bos, train_ids[i:i + ctx]]))
        o = torch.randint(0, train_ids.numel() - ctx - 1, (args.batch_size - n_bos,), generator=gen)
        for i in o.tolist():
            rows.append(train_ids[i:i + ctx + 1])
        xy = torch.stack(rows)
        return xy[:, :-1], xy[:, 1:]

    def train_step(x, y):
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        loss.backward()
        return loss.detach()

    step_fn = train_step if args.no_compile else torch.compile(train_step)

    # Learning rate: linear warmup, constant, then a linear decay over the last --decay-frac of
    # the run ("warmup-stable-decay"). The stable phase does not depend on the run length, so a
    # time budget can decide when to start decaying: under --minutes the decay starts when
    # (1 - decay_frac) of the training time is used, and its length in steps is fixed then from
    # the measured speed. With --steps N the decay covers the last --decay-steps (default
    # round(decay_frac * N)) steps, which makes the run a pure function of the arguments.
    decay_start = None
    decay_steps = None
    total = None
    if args.steps is not None:
        total = args.steps
        decay_steps = args.decay_steps or max(1, round(args.decay_frac * total))
        decay_start = total - decay_steps

    def lr_at(step):
        if step < args.warmup:
            lr = args.lr * (step + 1) / args.warmup
        else:
            lr = args.lr
        if decay_start is not None and step >= decay_start:
            frac = (step - decay_start + 1) / decay_steps
            lr = min(lr, args.lr * (1 - (1 - args.min_lr_frac) * frac))
        return lr

    history = {"train": [], "train_fine": [], "val": []}
    t0 = time.time()
    v0 = nll_per_char(model, val_eval_ids, len(val_text), ctx, ctx)
    eval_secs = time.time() - t0
    history["val"].append({"step": 0, "tokens": 0, "val_nats_per_char": v0, "elapsed_s": time.time() - t_start})
    print(f"step 0: validation {v0:.4f} nats/char (eval takes {eval_secs:.1f}s)", flush=True)

    t_train = time.time()
    t_end = t_start + args.minutes * 60  # --minutes mode: the training loop ends by then
    eval_interval_s = (t_end - t_train) / args.evals
    next_eval_t = t_train + eval_interval_s
    eval_every = None if args.steps is None else max(1, total // args.evals)
    step_secs = []  # wall time of each optimizer step (not counting evaluations)
    running, run_n = 0.0, 0
    ema = None
    model.train()
    bar = tqdm(total=total, desc="train", mininterval=2.0, dynamic_ncols=True, file=sys.stderr)
    step = 0
    while total is None or step < total:
        ts = time.time()
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = get_batch()
        loss = step_fn(x, y)
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        li = loss.item()
        step += 1
        step_secs.append(time.time() - ts)
        ema = li if ema is None else 0.98 * ema + 0.02 * li
        running += li
        run_n += 1
        if step % 10 == 0:
            history["train_fine"].append({"step": step, "tokens": step * args.batch_size * ctx, "loss_tok": ema})
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", nats_char=f"{ema / train_cpt:.3f}", lr=f"{lr:.2e}", refresh=False)
        now = time.time()
        if total is None and now >= t_train + (1 - args.decay_frac) * (t_end - t_train):
            # fix the decay length from the recent speed (the first 2 steps include compilation)
            recent = step_secs[2:][-100:] or step_secs
            sec_per_step = sum(recent) / len(recent)
            evals_left = max(0, int((t_end - now) / eval_interval_s))
            decay_steps = max(1, int((t_end - now - evals_left * eval_secs) / sec_per_step))
            decay_start = step
            total = step + decay_steps
            bar.total = total
            bar.refresh()
            bar.write(f"decay: {sec_per_step:.3f} s/step ({args.batch_size * ctx / sec_per_step:,.0f} tokens/s); "
                      f"linear decay over {decay_steps} steps, total {total} steps")
        if eval_every is not None:
            do_eval = step % eval_every == 0 or step == total
        else:
            do_eval = now >= next_eval_t or step == total
            while next_eval_t <= now:
                next_eval_t += eval_interval_s
        if do_eval:
            history["train"].append({"step": step, "tokens": step * args.batch_size * ctx,
                                     "loss_tok": running / run_n, "lr": lr})
            running, run_n = 0.0, 0
            te = time.time()
            v = nll_per_char(model, val_eval_ids, len(val_text), ctx, ctx)
            eval_secs = time.time() - te
            history["val"].append({"step": step, "tokens": step * args.batch_size * ctx, "val_nats_per_char": v,
                                   "elapsed_s": time.time() - t_start})
            bar.write(f"step {step}/{total or '?'}: train {history['train'][-1]['loss_tok']:.4f} nats/token "
                      f"(~{history['train'][-1]['loss_tok'] / train_cpt:.3f} nats/char), validation {v:.4f} "
                      f"nats/char, lr {lr:.2e}, {time.time() - t_start:.0f}s elapsed")
            if args.log:
                with open(args.log, "w") as f:
                    json.dump(history, f, indent=1)
    bar.close()
    train_secs = time.time() - t_train
    tokens_seen = total * args.batch_size * ctx
    print(f"resolved schedule: --steps {total} --decay-steps {decay_steps}", flush=True)
    print(f"training: {total} steps, {tokens_seen:,} tokens ({tokens_seen / train_ids.numel():.1f} epochs) in "
          f"{train_secs:.0f}s ({tokens_seen / train_secs:,.0f} tokens/s)", flush=True)

    # final evaluation: overlapping windows so every scored token has >= ctx/2 context
    model.eval()
    t0 = time.time()
    val_final = nll_per_char(model, val_eval_ids, len(val_text), ctx, ctx // 2)
    # train: the same measurement on 10 evenly spaced slices of the training stream, as many
    # tokens in all as the validation text (the full training text would take ~10x longer)
    n_slices = 10
    slice_len = val_ids.numel() // n_slices
    train_nll, train_chars = 0.0, 0
    for k in range(n_slices):
        a = k * (train_ids.numel() - slice_len) // (n_slices - 1)
        piece = train_ids[a:a + slice_len]
        chars = len(tok.decode(piece.tolist()))
        train_nll += chars * nll_per_char(model, torch.cat([bos, piece]), chars, ctx, ctx // 2)
        train_chars += chars
    train_final = train_nll / train_chars
    val_chunks = history["val"][-1]["val_nats_per_char"]
    print(f"final: train {train_final:.4f} nats/char, validation {val_final:.4f} nats/char "
          f"(stride {ctx // 2}; {time.time() - t0:.0f}s)", flush=True)

    # ------------------------------------------------------------------ save
    out = args.out
    os.makedirs(out, exist_ok=True)
    for name in ("model.safetensors", "pytorch_model.bin", "chat_template.jinja"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(out, safe_serialization=True)
    # also spell dtype and rope theta the pre-v5 way, for readers of config.json that predate
    # transformers 5 (transformers 5 accepts and ignores the duplicates)
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg_json = json.load(f)
    cfg_json.setdefault("torch_dtype", "float32")
    cfg_json.setdefault("rope_theta", args.rope_theta)
    with open(cfg_path, "w") as f:
        json.dump(dict(sorted(cfg_json.items())), f, indent=2)
        f.write("\n")
    save_tokenizer(tok, out, args.max_pos)
    if args.log:
        with open(args.log, "w") as f:
            json.dump(history, f, indent=1)
    plot_curve(history, os.path.join(out, "loss_curve.png"), train_cpt, decay_start * args.batch_size * ctx)

    # reload exactly as users will, and generate the greedy samples from the saved files
    tok2 = AutoTokenizer.from_pretrained(out)
    model2 = AutoModelForCausalLM.from_pretrained(out)
    model2.eval()
    sd1, sd2 = model.state_dict(), model2.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1), "reloaded weights differ"
    chat = [{"role": "user", "content": "What light through yonder window breaks?"}]
    chat_text = tok2.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompts = [("ROMEO:\n", tok2("ROMEO:\n", return_tensors="pt").input_ids),
               ("First Citizen:\nWe are accounted poor citizens,",
                tok2("First Citizen:\nWe are accounted poor citizens,", return_tensors="pt").input_ids),
               (chat_text, torch.tensor([tok2.apply_chat_template(chat, add_generation_prompt=True,
                                                                  tokenize=True, return_dict=True)["input_ids"]]))]
    samples = []
    for ptxt, pids in prompts:
        with torch.no_grad():
            outids = model2.generate(pids, attention_mask=torch.ones_like(pids), max_new_tokens=80,
                                     do_sample=False)
        completion = tok2.decode(outids[0, pids.size(1):], skip_special_tokens=True)
        samples.append((ptxt, pids[0].tolist(), completion))
        print("=" * 60 + f"\nprompt {ptxt!r} -> {completion!r}", flush=True)

    wall = time.time() - t_start
    cfg = model.config
    repro = ("" if args.steps is not None else
             f"; the time budget resolved to `--steps {total} --decay-steps {decay_steps}`, add those to repeat "
             "this run exactly")
    card = f"""# shakespeare-llama

A tiny Llama-architecture causal language model trained from scratch on Tiny Shakespeare,
bundled with pagedllm as its default model so that `pagedllm serve` and `LLM()` produce real
text on a machine without internet. It is a toy: it writes Shakespeare-flavoured text, it
knows nothing else, and it was trained on CPU in about half an hour.

## Architecture

`LlamaForCausalLM` (RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention),
fp32 weights, input and output embeddings tied.

| | |
|---|---|
| parameters | {n_params:,} ({n_params / 1e6:.2f} M) |
| layers | {cfg.num_hidden_layers} |
| hidden size | {cfg.hidden_size} |
| SwiGLU intermediate size | {cfg.intermediate_size} |
| attention heads / KV heads | {cfg.num_attention_heads} / {cfg.num_key_value_heads} (head dim {cfg.head_dim}) |
| vocabulary | {V} (byte-level BPE) |
| RoPE theta | {args.rope_theta:g} |
| max_position_embeddings | {cfg.max_position_embeddings} (trained on {ctx}-token windows; quality beyond {ctx} tokens is untested) |

## Tokenizer

Byte-level BPE (`tokenizers`: ByteLevel pre-tokenizer and decoder, no prefix space) with a
vocabulary of {V}, trained on the training part of the text only. Any byte string round-trips.
Special tokens: `<s>` = 0 (bos), `</s>` = 1 (eos), `<pad>` = 2 (pad). Encoding with
`add_special_tokens=True` (the default) prepends `<s>`, like Llama tokenizers.

Chat template: each message becomes a speech in a play, `ROLE:` on its own line, the text,
then a blank line; `user` speaks as {USER_NAME}, `assistant` as {ASSISTANT_NAME}, a `system`
message is a plain paragraph, and the generation prompt is `{ASSISTANT_NAME}:\\n`:

```jinja
{CHAT_TEMPLATE}
```

The model never saw `</s>` during training (it learned from one continuous stream of text),
so it does not stop by itself: generation ends at `max_tokens` (a stop string such as
`"\\n\\n"` ends a chat reply after one speech).

## Training

Data: `tinyshakespeare.txt` ({len(text):,} characters, from karpathy/char-rnn, public domain).
The first {1 - args.val_frac:.0%} ({len(train_text):,} characters, {train_ids.numel():,} tokens) is
training text; the last {args.val_frac:.0%} ({len(val_text):,} characters, {val_ids.numel():,} tokens)
is held out for validation and never seen by the tokenizer or the model. Training samples are
random {ctx}-token windows of the training token stream; {args.bos_frac:.0%} of them start at the
beginning of a speech (after a blank line) and are prefixed with `<s>`, the rest start anywhere
without `<s>`, so prompts work with or without a leading `<s>`.

Optimisation: AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), peak
learning rate {args.lr:g}: {args.warmup} linear warmup steps, constant, then linear decay to {args.min_lr_frac:g} x peak
over the last {decay_steps} steps,
batch {args.batch_size} x {ctx} tokens, gradient clipping {args.grad_clip}, dropout {args.dropout}
on embeddings and residual branches during training only (applied with hooks; the saved model
has no dropout), seed {args.seed}, {total} steps = {tokens_seen:,} tokens
({tokens_seen / train_ids.numel():.1f} epochs), `torch.compile`d training step, fp32, {args.threads} CPU threads.

Command (run from the repository root){repro}:

```
{command}
```

Wall time: {wall / 60:.1f} minutes in all ({train_secs / 60:.1f} minutes in the training loop) on
{args.threads} CPU cores ({cpu_model()}), shared with other work; torch {torch.__version__}.

## Results

Loss per character = total token negative log-likelihood / number of characters of the text
evaluated (every token of the text is scored once, the first one after `<s>`; windows of {ctx}
tokens with stride {ctx // 2}, so each scored token has at least {ctx // 2} tokens of context). It is
comparable across tokenizers (a character-level model's loss is already per character).

| | nats / character | bits / character |
|---|---|---|
| train (10 evenly spaced slices, {train_chars:,} characters) | {train_final:.4f} | {train_final / math.log(2):.4f} |
| validation (last {args.val_frac:.0%}, {len(val_text):,} characters) | **{val_final:.4f}** | {val_final / math.log(2):.4f} |

Target: validation < 1.7 nats/character ({"reached" if val_final < 1.7 else "NOT reached"}).
During training the validation loss was measured with non-overlapping {ctx}-token windows
(final value {val_chunks:.4f}, a little higher because some tokens have short context).

![loss curve](loss_curve.png)

| step | tokens seen | validation nats/char |
|---|---|---|
""" + "".join(f"| {h['step']} | {h['tokens']:,} | {h['val_nats_per_char']:.4f} |\n" for h in history["val"]) + f"""
## Greedy samples

Generated with `transformers` (`AutoModelForCausalLM.from_pretrained` on this folder,
`generate(do_sample=False, max_new_tokens=80)`); prompt in the first lines, then the completion.
""" + "".join(
        f"\n{i + 1}. Prompt {ptxt!r} (token ids {pids}):\n\n```\n{ptxt}{comp}\n```\n"
        for i, (ptxt, pids, comp) in enumerate(samples)) + """
## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("pagedllm/assets/shakespeare-llama")
model = AutoModelForCausalLM.from_pretrained("pagedllm/assets/shakespeare-llama")
ids = tok("ROMEO:\\n", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=60, do_sample=False)[0], skip_special_tokens=True))
```
"""
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(card)
    print(f"wrote {out} in {wall / 60:.1f} minutes: params {n_params:,}, train {train_final:.4f}, "
          f"validation {val_final:.4f} nats/char", flush=True)


if __name__ == "__main__":
    main()
