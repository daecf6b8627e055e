"""A live budget (csrc/budget.c, Llama.moe_set_budget): g-lru pools give memory back and take it
again while the model runs, and the logits stay bit-identical to stock throughout."""

import os
import subprocess
import sys

import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.planning.index import load_index

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = b"The quick brown fox jumps over the lazy dog, and then"


def decode(llm, steps):
    """PROMPT, then for each (budget or None, n): the budget set, n greedy tokens. Returns (all
    logits [n_tokens, n_vocab], moe_stats()["budget"] right after each budget was set)."""
    llm.eval(llm.tokenize(PROMPT))
    seen = []
    for budget, n in steps:
        if budget is not None:
            llm.moe_set_budget(budget)
            seen.append(llm.moe_stats()["budget"])
        for _ in range(n):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return np.array(llm.scores[: llm.n_tokens], copy=True), seen


def floor_bytes(index):
    return max(index.n_expert_used * layer.expert_bytes for layer in index.layers)


@pytest.mark.parametrize("name", ["qwen3moe-q4_0", "qwen3moe-q8_0"])
def test_budget_moves_mid_decode_exactly(tmp_path, name):
    """Shrink to the floor in the middle of a decode, then grow back: the memory held follows the
    budget at once, and every logit equals stock's in the layout the run names."""
    path = fixtures.write_fixture(name, tmp_path)
    index = load_index(path)
    floor = floor_bytes(index)
    llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, moe_slots=index.n_expert // 2,
                moe_policy="g-lru")
    try:
        planned = llm.moe_stats()["budget"]["budget_bytes"]
        assert planned > 2 * floor
        logits, seen = decode(llm, [(None, 6), (floor, 6), (planned, 6)])
        stats = llm.moe_stats()
    finally:
        llm.close()
    shrunk, grown = seen
    assert shrunk["budget_bytes"] == floor and shrunk["resident_bytes"] <= floor   # given back at once
    assert shrunk["given_back_bytes"] > 0 and shrunk["lowest_bytes"] == floor
    assert grown["budget_bytes"] == planned and stats["budget"]["n_changes"] == 2
    assert stats["budget"]["resident_bytes"] > floor                               # taken again as read
    stock = Llama(str(path), n_ctx=256, logits_all=True, verbose=False,
                  moe_repack=stats["exact_to"] != "llama.cpp --no-repack")
    try:
        expected, _ = decode(stock, [(None, 18)])
    finally:
        stock.close()
    assert np.array_equal(logits, expected)


def test_budget_is_refused_where_it_cannot_hold(tmp_path):
    path = fixtures.write_fixture("qwen3moe-q8_0", tmp_path)
    index = load_index(path)
    llm = Llama(str(path), n_ctx=64, verbose=False, moe_slots=index.n_expert // 2, moe_policy="lru")
    try:
        with pytest.raises(ValueError, match="g-lru"):
            llm.moe_set_budget(10 * floor_bytes(index))
        assert llm.moe_stats()["budget"] is None
    finally:
        llm.close()
    llm = Llama(str(path), n_ctx=64, verbose=False, moe_slots=index.n_expert // 2, moe_policy="g-lru")
    try:
        with pytest.raises(ValueError, match="below the floor"):
            llm.moe_set_budget(floor_bytes(index) - 1)
        with pytest.raises(ValueError, match="give a size"):
            llm.moe_set_budget("lots")
        llm.moe_set_budget(f"{floor_bytes(index)}")  # bytes as text: a size too
    finally:
        llm.close()
    stock = Llama(str(path), n_ctx=64, verbose=False)
    try:
        with pytest.raises(ValueError, match="no slot pools"):
            stock.moe_set_budget("1GiB")
    finally:
        stock.close()


RSS_SCRIPT = """
import sys
from empanel_gguf import Llama
from empanel_gguf.models import fixtures
path = fixtures.write_fixture("qwen3moe-rss", sys.argv[1])
llm = Llama(str(path), n_ctx=128, verbose=False, moe_slots=64, moe_policy="g-lru")
def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("RssAnon")][0].split()[1]) * 1024
for t in range(60):
    llm.eval([(7 * t + 3) % 250 + 1])
before = (rss(), llm.moe_stats()["budget"]["resident_bytes"])
llm.moe_set_budget(int(sys.argv[2]))
after = (rss(), llm.moe_stats()["budget"]["resident_bytes"])
print("RSSANON", *before, *after)
"""


def test_budget_gives_pages_back(tmp_path):
    """A lower budget returns the emptied slots' pages to the kernel at once: the process's
    anonymous memory falls by about the bytes the budget let go (pages of partly used slots
    aside)."""
    index = load_index(fixtures.write_fixture("qwen3moe-rss", tmp_path))
    floor = floor_bytes(index)
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path), str(floor)], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    line = [text for text in proc.stdout.splitlines() if text.startswith("RSSANON")]
    assert line, proc.stderr[-2000:]
    rss_before, resident_before, rss_after, resident_after = (int(x) for x in line[0].split()[1:])
    assert resident_after <= floor < resident_before
    assert rss_before - rss_after >= 0.7 * (resident_before - resident_after), (rss_before, rss_after)
