"""The shipped built-in model (empanel_gguf/models/shakespeare-moe.gguf, made by
scripts/train_moe.py; see models/PROVENANCE.md): it loads, its routing is learned (far from
uniform), it writes word-like text, and slot pools at the minimum are bit-identical to every
expert resident.
"""

import math
import re

import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.commands.options import BUILTIN_MODEL, default_model_path
from empanel_gguf.lab.exactness import greedy_logits
from empanel_gguf.planning.index import load_index

pytestmark = pytest.mark.skipif(not BUILTIN_MODEL.is_file(), reason="the built-in model is not shipped here")

PROMPT = b"ROMEO.\nO, she doth teach the torches to burn bright!"
# routing is recorded on this passage (from the training text: the check is that routing is
# skewed, which random routers are not)
TRACE_TEXT = (b"HAMLET.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind "
              b"to suffer\nThe slings and arrows of outrageous fortune,\nOr to take arms against a "
              b"sea of troubles,\nAnd by opposing end them? To die, to sleep;\nNo more; and by a sleep "
              b"to say we end\nThe heart-ache and the thousand natural shocks\nThat flesh is heir to, "
              b"'tis a consummation\nDevoutly to be wish'd. To die, to sleep.\n")


@pytest.fixture(scope="module")
def index():
    return load_index(str(BUILTIN_MODEL))


def test_is_the_default_and_small(index):
    assert default_model_path() == BUILTIN_MODEL
    assert BUILTIN_MODEL.stat().st_size <= 20 * 2**20
    assert (BUILTIN_MODEL.parent / "PROVENANCE.md").is_file()
    assert index.architecture == "qwen3moe"
    assert index.is_moe and len(index.layers) >= 4
    assert index.n_expert >= 16 and index.n_expert_used > 1


def _entropy_bits(ids, n):
    p = np.bincount(ids.ravel(), minlength=n) / ids.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def test_routing_is_learned(index):
    """On a Shakespeare passage (llama.cpp's own routing, every expert resident): expert usage is
    below the uniform entropy in every layer, further than a uniform random routing of the same
    tokens gets, and consecutive tokens share experts more often than chance (k/E).

    The model is small and was trained with a load-balancing loss, so the margins are modest
    (models/PROVENANCE.md: 4.66-4.86 bits of 5 here, random 4.95-4.97); routing is deterministic,
    so they do not flake."""
    from empanel_gguf.lab.recorder import Recorder

    llm = Llama(str(BUILTIN_MODEL), n_ctx=256, moe_trace=True, logits_all=True, verbose=False,
                seed=0)  # logits_all: the last layer runs every token too
    try:
        rec = Recorder(llm)
        rec.prompt(llm.tokenize(TRACE_TEXT))
        trace = rec.trace()
    finally:
        llm.close()
    E, k = index.n_expert, index.n_expert_used
    uniform = math.log2(E)
    rng = np.random.default_rng(0)
    entropies, overlaps = [], []
    for j in range(trace.experts.shape[1]):
        ids = trace.experts[:, j]
        ids = ids[ids[:, 0] >= 0].astype(np.int64)
        assert len(ids) > 100
        random_ids = np.array([rng.choice(E, size=k, replace=False) for _ in ids])
        h, h_random = _entropy_bits(ids, E), _entropy_bits(random_ids, E)
        assert h < h_random - 0.05 and h < uniform - 0.1, f"layer {j}: {h:.3f} bits, random {h_random:.3f}"
        entropies.append(h)
        overlaps.append((ids[1:, :, None] == ids[:-1, None, :]).any(-1).mean())
    assert np.mean(entropies) < uniform - 0.15, entropies
    assert np.mean(overlaps) > k / E + 0.04, overlaps  # chance: k / E


def test_writes_words():
    llm = Llama(str(BUILTIN_MODEL), n_ctx=256, verbose=False, seed=0)
    try:
        text = llm(PROMPT.decode(), max_tokens=64, temperature=0.0, repeat_penalty=1.0)["choices"][0]["text"]
    finally:
        llm.close()
    assert len(text) > 100, text
    printable = sum(c.isprintable() or c in "\n\t" for c in text) / len(text)
    assert printable > 0.99, text
    words = re.findall(r"[A-Za-z']+", text)
    assert len(words) >= 15, text
    wordlike = [w for w in words if len(w) <= 14 and re.search(r"[aeiouyAEIOUY]", w)]
    assert len(wordlike) / len(words) > 0.9, text
    assert len(set(w.lower() for w in words)) >= 8, text  # not one word over and over


def test_min_slots_bit_identical(index):
    """moe_slots at the minimum (top-k): n_ubatch becomes 1; the baseline runs with n_ubatch 1 too."""
    k = index.n_expert_used

    def run(moe_slots):
        llm = Llama(str(BUILTIN_MODEL), n_ctx=256, n_batch=64, n_ubatch=1, logits_all=True, seed=0,
                    verbose=False, moe_slots=moe_slots)
        try:
            logits, tokens = greedy_logits(llm, PROMPT, 16)
            return logits, tokens, llm.moe_stats()
        finally:
            llm.close()

    logits, tokens, stats = run(k)
    ref_logits, ref_tokens, ref_stats = run(None)
    assert ref_stats is None
    assert stats["total"]["misses"] > 0
    assert tokens == ref_tokens
    assert np.array_equal(logits, ref_logits), f"max |diff| {np.abs(logits - ref_logits).max()}"
