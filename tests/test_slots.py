"""Exactness of the slot pools: logits and greedy tokens equal, bit for bit, the same build with
every expert resident (moe_slots=None) at the same micro-batch size.

Slot runs cap n_ubatch (a micro-batch must fit its pools), and llama.cpp's kernels differ by batch
size, so each baseline runs with the n_ubatch the slot run used.
"""

import numpy as np
import pytest

from empanel_gguf import Llama, fixtures
from empanel_gguf.exactness import greedy_logits
from empanel_gguf.index import load_index
from empanel_gguf.sizing import UNCAPPED_UBATCH, plan_slots

PROMPT = b"The quick brown fox jumps over the lazy dog, and then"
OTHER_PROMPTS = (b"Once upon a time in a land far away", b"1, 2, 3, 4, 5, 6, 7, 8")
N_GREEDY = 32


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slots-fixtures")


def run(path, prompt, moe_slots, n_ubatch, n_greedy=N_GREEDY):
    """(all logits [n_tokens, n_vocab], greedy tokens, stats) for prompt + n_greedy tokens."""
    llm = Llama(str(path), n_ctx=256, n_batch=64, n_ubatch=n_ubatch, logits_all=True, seed=0,
                verbose=False, moe_slots=moe_slots)
    try:
        assert llm.n_batch == 64 and llm.context_params.n_ubatch <= n_ubatch
        logits, tokens = greedy_logits(llm, prompt, n_greedy)
        return logits, tokens, llm.moe_stats(), llm.context_params.n_ubatch
    finally:
        llm.close()


_baselines = {}


def baseline(path, prompt, n_ubatch, n_greedy=N_GREEDY):
    key = (str(path), prompt, n_ubatch, n_greedy)
    if key not in _baselines:
        _baselines[key] = run(path, prompt, None, n_ubatch, n_greedy)
    return _baselines[key]


def slot_settings(name):
    spec = fixtures.FIXTURES[name]
    return [spec.n_expert_used, "25%", spec.n_expert]


CASES = [(name, slots) for name in fixtures.FIXTURES for slots in slot_settings(name)]


@pytest.mark.parametrize("name,moe_slots", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_bit_identical_to_resident(fixture_dir, name, moe_slots):
    path = fixtures.write_fixture(name, fixture_dir)
    logits, tokens, stats, n_ubatch = run(path, PROMPT, moe_slots, n_ubatch=512)
    plan = plan_slots(load_index(path), moe_slots)
    assert n_ubatch == min(64, plan.max_ubatch)  # n_batch 64 bounds it; pools of every expert don't

    ref_logits, ref_tokens, ref_stats, _ = baseline(path, PROMPT, n_ubatch)
    assert ref_stats is None
    assert tokens == ref_tokens
    assert logits.shape == ref_logits.shape
    assert np.array_equal(logits, ref_logits), f"max |diff| {np.abs(logits - ref_logits).max()}"

    total = stats["total"]
    assert total["n_slots"] == sum(plan.n_slots)
    if plan.holds_all:
        # all experts fit: each is read once, at load (moe_preload's default), none on demand
        index = load_index(path)
        assert total["misses"] == 0 and total["bytes_read"] == index.expert_bytes_total
    else:
        assert total["misses"] > 0 and total["bytes_read"] > 0


def test_micro_batch_larger_than_one(fixture_dir):
    """A pool of all 256 experts admits micro-batches of 256 / top-8 = 32 tokens."""
    path = fixtures.write_fixture("qwen3moe-256x", fixture_dir)
    logits, tokens, stats, n_ubatch = run(path, PROMPT * 3, 256, n_ubatch=32, n_greedy=8)
    assert n_ubatch == 32
    ref_logits, ref_tokens, _, _ = baseline(path, PROMPT * 3, 32, n_greedy=8)
    assert tokens == ref_tokens
    assert np.array_equal(logits, ref_logits)
    # the prompt went through in micro-batches of 32 tokens: far fewer remaps than tokens
    n_prompt = logits.shape[0] - 8
    layers = len(load_index(path).layers)
    assert stats["total"]["n_remaps"] < layers * (n_prompt + 8)


def test_prompts_in_a_row_share_the_pools(fixture_dir):
    """One model, several prompts one after another (reset between): each as from fresh."""
    path = fixtures.write_fixture("qwen3moe-q4_0", fixture_dir)
    spec = fixtures.FIXTURES["qwen3moe-q4_0"]
    llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, moe_slots=spec.n_expert_used)
    try:
        n_ubatch = llm.context_params.n_ubatch
        for prompt in (PROMPT,) + OTHER_PROMPTS:
            llm.reset()
            llm.eval(llm.tokenize(prompt))
            got = np.array(llm.scores[: llm.n_tokens], copy=True)
            ref = run(path, prompt, None, n_ubatch, n_greedy=0)[0]
            assert np.array_equal(got, ref)
        assert llm.moe_stats()["total"]["hits"] > 0
    finally:
        llm.close()


def test_stats_shape(fixture_dir):
    path = fixtures.write_fixture("qwen3moe-f16", fixture_dir)
    index = load_index(path)
    llm = Llama(str(path), n_ctx=128, verbose=False, moe_slots="50%")
    try:
        stats = llm.moe_stats()
        assert set(stats["layers"]) == set(index.moe_layers)
        assert stats["total"]["bytes_read"] == 0  # nothing read before the first decode
        llm.eval(llm.tokenize(b"hello"))
        stats = llm.moe_stats()
        for row in stats["layers"].values():
            assert row["n_slots"] == 8
            assert 0 < row["n_resident"] <= 8
            assert row["hits"] + row["misses"] > 0
        for il, row in stats["layers"].items():
            assert row["bytes_read"] == row["misses"] * index.layer(il).expert_bytes
        assert 0.0 <= stats["total"]["hit_rate"] <= 1.0
    finally:
        llm.close()


def test_without_slots_is_stock(fixture_dir):
    path = fixtures.write_fixture("qwen3moe-f16", fixture_dir)
    llm = Llama(str(path), n_ctx=128, verbose=False)
    try:
        assert llm.moe_stats() is None
        assert llm.context_params.n_ubatch == 128  # min(n_ctx, n_batch, n_ubatch), uncapped
    finally:
        llm.close()


def test_auto_slots_follow_available_memory(fixture_dir, monkeypatch):
    """moe_slots="auto": stock when the model fits, else the most slots that fit."""
    from empanel_gguf import memory

    path = fixtures.write_fixture("qwen3moe-rss", fixture_dir)
    monkeypatch.setenv("EMPANEL_MEM_AVAILABLE", "64GiB")
    llm = Llama(str(path), n_ctx=128, verbose=False, moe_slots="auto")
    assert llm.moe_stats() is None  # everything fits: every expert resident
    llm.close()

    index = load_index(path)
    floor = memory.default_floor()
    full = memory.estimate(index, None, n_ctx=128).host
    # room for about half of the experts on top of everything else
    available = floor + full - index.expert_bytes_total // 2
    monkeypatch.setenv("EMPANEL_MEM_AVAILABLE", str(available))
    llm = Llama(str(path), n_ctx=128, verbose=False, moe_slots="auto")
    try:
        n_slots = llm.moe_stats()["total"]["n_slots"] // len(index.layers)
        assert index.n_expert_used <= n_slots < index.n_expert
        assert memory.estimate(index, plan_slots(index, n_slots), n_ctx=128).host <= available - floor
    finally:
        llm.close()


def test_micro_batch_cap_follows_the_pools(fixture_dir):
    index = load_index(fixtures.write_fixture("qwen3moe-f16", fixture_dir))
    n, k = index.n_expert, index.n_expert_used
    assert plan_slots(index, k).max_ubatch == 1
    assert plan_slots(index, 2 * k).max_ubatch == 2
    # pools that hold every expert fit any micro-batch
    assert plan_slots(index, n).holds_all
    assert plan_slots(index, n).max_ubatch == UNCAPPED_UBATCH
    assert plan_slots(index, n, policy="g-lru").max_ubatch == UNCAPPED_UBATCH
    # g-lru with room for every expert per layer but half the budget stays capped
    half = plan_slots(index, n // 2, policy="g-lru")
    assert max(half.n_slots) == n and not half.holds_all
    assert half.max_ubatch == n // k
