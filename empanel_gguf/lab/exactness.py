"""The exactness check's one run: a prompt, then greedy tokens, with every logit kept.

Slot pools must give logits bit-identical to the same build with every expert resident at the
same micro-batch size; tests and scripts/gpu_check.py compare two such runs with
numpy.array_equal.
"""

import numpy as np


def greedy_logits(llm, prompt, n_greedy=0):
    """Eval `prompt` (bytes, or a list of tokens) on a fresh or reset Llama made with
    logits_all=True, then n_greedy greedy tokens one at a time. Returns (logits [n_tokens,
    n_vocab], the greedy tokens)."""
    llm.eval(llm.tokenize(prompt) if isinstance(prompt, bytes) else list(prompt))
    tokens = []
    for _ in range(n_greedy):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        llm.eval([token])
    return np.array(llm.scores[: llm.n_tokens], copy=True), tokens
