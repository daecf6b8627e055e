"""The plan's micro-batch (moe_batch, issue 54): where the pools page, a prompt goes in calls of up
to 2,048 tokens, each one micro-batch with flash attention, so that its waves read each expert
once per call; the product names the stock command its logits equal, and they do, bit for bit.
Where nothing pages, or the caller chose n_batch / n_ubatch / flash_attn, nothing changes."""

import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.commands.programs import plan_for_program, setup_arg_parser, split_args
from empanel_gguf.lab.exactness import greedy_logits
from empanel_gguf.models import fixtures
from empanel_gguf.planning.estimate import estimate
from empanel_gguf.planning.index import load_index
from empanel_gguf.planning.options import moe_options
from empanel_gguf.planning.plan import micro_batch_flags, plan_load, planned_batch, stock_equivalent, stock_kwargs

TEXT = b" ".join(b"%d: the %s fox and the lazy dog, seen %d times." % (i, b"quick" if i % 3 else b"slow", i * 7)
                 for i in range(300))
GiB = 1 << 30


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fixtures.write_fixture("qwen3moe-q4_k", tmp_path_factory.mktemp("batch"))


def test_the_rule():
    fast = {"n_batch": 2048, "n_ubatch": 2048, "flash_attn": True}
    assert planned_batch("auto", "auto", {}, 4096) == fast
    assert planned_batch("auto", 4, {}, 1024) == dict(fast, n_batch=1024, n_ubatch=1024)  # at most n_ctx
    assert planned_batch("auto", 4, {}, 512) == {}  # nothing to gain: one call of 512 as before
    assert planned_batch("auto", None, {}, 4096) == {}  # no pools
    for given in ({"n_batch": 512}, {"n_ubatch": 256}, {"flash_attn": False}, {"n_gpu_layers": 10}):
        assert planned_batch("auto", 4, given, 4096) == {}, given  # the caller's choice stands
    assert planned_batch("stock", 4, {}, 4096) == {}
    assert planned_batch(4096, 4, {}, 8192) == {"n_batch": 4096, "n_ubatch": 4096, "flash_attn": True}
    assert planned_batch(4096, 4, {"flash_attn": False}, 2048) == {"n_batch": 2048, "n_ubatch": 2048}
    with pytest.raises(ValueError, match="moe_batch=4096 with n_batch"):
        planned_batch(4096, 4, {"n_batch": 512}, 8192)
    with pytest.raises(ValueError, match="moe_batch"):
        moe_options(moe_batch="huge")
    assert stock_equivalent(False, None, {"n_batch": 2048, "n_ubatch": 2048, "flash_attn": True}) == \
        "llama.cpp --no-repack -b 2048 -ub 2048 -fa on"
    assert stock_equivalent(True, None, {}) == "llama.cpp with its defaults"
    assert stock_kwargs(False, None, {"n_batch": 64, "n_ubatch": 64}) == {"moe_repack": False, "n_batch": 64,
                                                                         "n_ubatch": 64}
    assert stock_kwargs(False, 0.5, {}) is None  # routing substitution: no stock run equals it


def test_only_where_the_pools_page(model):
    index = load_index(model)
    paged = plan_load(index, 4, {"n_ctx": 2048}, available=64 * GiB, floor=0)
    assert paged.micro_batch == {"n_batch": 2048, "n_ubatch": 2048, "flash_attn": True}
    assert any("moe-batch" in note for note in paged.notes)
    # the estimate counts the larger micro-batch (with flash attention: no KQ of n_ctx per token)
    assert paged.estimate.params["n_ubatch"] == 2048 and paged.estimate.params["flash_attn"]
    full = plan_load(index, index.n_expert, {"n_ctx": 2048}, available=64 * GiB, floor=0)
    assert full.plan.holds_all and full.micro_batch == {}  # nothing pages: stock's defaults
    auto_all = plan_load(index, "auto", {"n_ctx": 2048}, available=64 * GiB, floor=0)
    assert auto_all.plan is None and auto_all.micro_batch == {}
    mine = plan_load(index, 4, {"n_ctx": 2048, "n_batch": 256}, available=64 * GiB, floor=0)
    assert mine.micro_batch == {} and mine.estimate.params["n_batch"] == 256


def test_the_compute_buffer_grows_with_the_micro_batch(model):
    """Measured on the 30B shape with flash attention: 96 MiB at 512 tokens, 385 MiB at 2,048
    (llama.cpp's "CPU compute buffer size"); the estimate follows it within 25 %."""
    index = load_index(model)
    small = estimate(index, None, n_ctx=4096, n_batch=512, n_ubatch=512, flash_attn=True).compute
    large = estimate(index, None, n_ctx=4096, n_batch=2048, n_ubatch=2048, flash_attn=True).compute
    no_fa = estimate(index, None, n_ctx=4096, n_batch=2048, n_ubatch=2048, flash_attn=False).compute
    assert large > small and no_fa > large


@pytest.mark.parametrize("n_prompt", [700, 1500])
def test_a_long_prompt_is_one_call_per_micro_batch_and_exact(model, n_prompt):
    """n_ctx 2048: 700 tokens are one call and one micro-batch; 1500 too (every expert read at
    most once for the prompt). The logits equal stock loaded as exact_kwargs says, bit for bit."""
    llm = Llama(str(model), n_ctx=2048, logits_all=True, verbose=False, moe_slots=4)
    try:
        assert llm.context_params.n_ubatch == llm.n_batch == 2048
        tokens = llm.tokenize(TEXT)[:n_prompt]
        assert len(tokens) == n_prompt
        logits, greedy = greedy_logits(llm, tokens, 6)
        stats = llm.moe_stats()
    finally:
        llm.close()
    assert stats["exact_to"] == "llama.cpp --no-repack -b 2048 -ub 2048 -fa on"
    index = load_index(model)
    for row in stats["layers"].values():
        assert row["n_remaps"] == 1 + 6  # the prompt's one micro-batch, then one per decoded token
    prompt_misses = stats["total"]["misses"]
    assert prompt_misses > 0
    ref = Llama(str(model), n_ctx=2048, logits_all=True, verbose=False, **stats["exact_kwargs"])
    try:
        ref_logits, ref_greedy = greedy_logits(ref, tokens, 6)
    finally:
        ref.close()
    assert greedy == ref_greedy and np.array_equal(logits, ref_logits), np.abs(logits - ref_logits).max()
    # each expert read at most once per layer for the prompt, plus the decode's misses
    assert stats["total"]["misses"] <= len(stats["layers"]) * (index.n_expert + 6 * index.n_expert_used)


def test_llama_cpp_programs_get_the_flags(model):
    """llama-server and llama-cli get -b / -ub / -fa on where the plan sets them; a program given
    -ub keeps it, and llama-bench measures what it is given."""
    parser = setup_arg_parser("llama-server")

    def plan(name, *flags):
        ours, theirs = split_args(parser, ["--moe-slots", "4", *flags])
        return plan_for_program(name, parser.parse_args(ours), theirs)

    def batch_flags(load):
        return micro_batch_flags(load.micro_batch)

    load = plan("llama-server", "-m", str(model), "-c", "4096")
    assert batch_flags(load) == ["-b", "2048", "-ub", "2048", "-fa", "on"]
    assert batch_flags(plan("llama-server", "-m", str(model), "-c", "4096", "-ub", "256")) == []
    assert batch_flags(plan("llama-server", "-m", str(model), "-c", "4096", "-fa", "off")) == []
    assert batch_flags(plan("llama-bench", "-m", str(model), "-p", "2048")) == []


def test_a_cold_prompt_reads_the_next_layer_ahead(tmp_path_factory, monkeypatch):
    """A prompt in waves routes to every expert of every layer: while a layer's waves compute, the
    next layer's empty slots are read ahead (behind the layer's own reads), and its first waves
    find them resident instead of reading them while the graph waits. Never into the last layer
    (llama.cpp computes only the kept outputs there), none with EMPANEL_PROMPT_AHEAD=0; logits
    unchanged. (It is on by default, while a decode reads nothing ahead: moe_prefetch="auto".)"""
    path = fixtures.write_fixture("qwen3moe-f16", tmp_path_factory.mktemp("ahead"))

    def run(**moe):
        llm = Llama(str(path), n_ctx=2048, logits_all=True, verbose=False, moe_slots=4, **moe)
        try:
            logits, _ = greedy_logits(llm, llm.tokenize(TEXT)[:700], 0)  # the prompt only: no decode guesses
            return logits, llm.moe_stats()
        finally:
            llm.close()

    ahead, stats = run()
    monkeypatch.setenv("EMPANEL_PROMPT_AHEAD", "0")
    plain, off = run()
    monkeypatch.delenv("EMPANEL_PROMPT_AHEAD")
    rows = [stats["layers"][il] for il in sorted(stats["layers"])]
    assert len(rows) >= 3
    assert rows[0]["prefetched"] == 0 and rows[-1]["prefetched"] == 0
    for row in rows[1:-1]:
        assert row["prefetched"] == row["n_slots"] and row["prefetch_used"] == row["prefetched"], row
    assert off["total"]["prefetched"] == 0
    assert stats["total"]["misses"] == off["total"]["misses"] - sum(row["prefetched"] for row in rows)
    assert np.array_equal(ahead, plain)
