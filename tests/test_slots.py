"""Exactness of the slot pools: logits and greedy tokens equal, bit for bit, stock llama.cpp
(moe_slots=None) in the weight layout the run names (moe_stats()["exact_to"]: stock's defaults
where the pools hold every expert, --no-repack where they page), micro-batch included.

No micro-batch cap: a micro-batch whose tokens route to more distinct experts than a pool holds
runs in waves (each wave's experts resident, its pairs computed by the same kernels, written into
one output). Every run leaves llama-cpp-python's arguments as they are: where the pools page, the
plan's micro-batch (moe_batch "auto": n_batch = n_ubatch = n_ctx here, flash attention) applies,
and the stock run compared is the one the pooled run names (moe_stats()["exact_kwargs"]).
"""

import re

import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.planning import estimate, host_memory
from empanel_gguf.lab.exactness import greedy_logits
from empanel_gguf.planning.index import load_index
from empanel_gguf.planning.sizing import plan_slots

PROMPT = b"The quick brown fox jumps over the lazy dog, and then"
OTHER_PROMPTS = (b"Once upon a time in a land far away", b"1, 2, 3, 4, 5, 6, 7, 8")
N_GREEDY = 16
PROMPT_LENGTHS = (1, 9, 100, 700)  # 700: one call in waves (the plan's micro-batch); stock's: two calls
LONG_TEXT = b" ".join(b"%d: the %s fox and the %s dog, seen %d times." % (i, b"quick" if i % 3 else b"slow",
                      b"lazy" if i % 2 else b"old", i * 7) for i in range(200))
N_CTX = 1024


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slots-fixtures")


def prompt_tokens(llm, n):
    tokens = llm.tokenize(LONG_TEXT)
    assert len(tokens) >= n
    return tokens[:n]


def run_stock_defaults(path, n_prompt, moe_slots, n_greedy=N_GREEDY, **moe):
    """(all logits [n_tokens, n_vocab], greedy tokens, stats, n_ubatch) for n_prompt tokens of
    LONG_TEXT + n_greedy greedy tokens; every llama-cpp-python default left as it is."""
    llm = Llama(str(path), n_ctx=N_CTX, logits_all=True, verbose=False, moe_slots=moe_slots, **moe)
    try:
        logits, tokens = greedy_logits(llm, prompt_tokens(llm, n_prompt), n_greedy)
        return logits, tokens, llm.moe_stats(), llm.context_params.n_ubatch
    finally:
        llm.close()


_baselines = {}


def stock_kwargs(stats):
    """The arguments of the stock run a pooled run equals (moe_stats()["exact_kwargs"]): the
    layout (moe_repack auto pages plain pools: --no-repack) and the plan's micro-batch."""
    return {"moe_repack": True} if stats is None else stats["exact_kwargs"]


def baseline(path, n_prompt, stats=None):
    """Stock llama.cpp with every expert resident, as the pooled run with these stats names it."""
    kwargs = stock_kwargs(stats)
    key = (str(path), n_prompt, tuple(sorted(kwargs.items())))
    if key not in _baselines:
        _baselines[key] = run_stock_defaults(path, n_prompt, None, **kwargs)
    return _baselines[key]


def slot_settings(name):
    spec = fixtures.FIXTURES[name]
    return [spec.n_expert_used, "25%", spec.n_expert]


CASES = [(name, slots) for name in fixtures.FIXTURES for slots in slot_settings(name)]


@pytest.mark.parametrize("name,moe_slots", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_bit_identical_to_stock_defaults(fixture_dir, name, moe_slots):
    path = fixtures.write_fixture(name, fixture_dir)
    index = load_index(path)
    plan = plan_slots(index, moe_slots)
    for n_prompt in PROMPT_LENGTHS:
        logits, tokens, stats, n_ubatch = run_stock_defaults(path, n_prompt, moe_slots)
        ref_logits, ref_tokens, ref_stats, ref_ubatch = baseline(path, n_prompt, stats)
        assert ref_stats is None
        # stock's own micro-batch where the pools hold every expert; where they page, the plan's:
        # each prompt call of up to n_ctx tokens one micro-batch
        assert n_ubatch == ref_ubatch == (512 if plan.holds_all else N_CTX)
        assert tokens == ref_tokens, f"{n_prompt} prompt tokens"
        assert logits.shape == ref_logits.shape
        assert np.array_equal(logits, ref_logits), \
            f"{n_prompt} prompt tokens: max |diff| {np.abs(logits - ref_logits).max()}"

        # auto layout: stock's defaults where the pools hold every expert, --no-repack where they page
        assert stats["exact_to"] == ("llama.cpp with its defaults" if plan.holds_all
                                     else f"llama.cpp --no-repack -b {N_CTX} -ub {N_CTX} -fa on")
        total = stats["total"]
        assert total["n_slots"] == sum(plan.n_slots)
        if plan.holds_all:
            # all experts fit: each is read once, at load (moe_preload's default), none on demand,
            # and the pools are pinned: stock's graph, no remap at all
            assert total["misses"] == 0 and total["bytes_read"] == index.expert_bytes_total
            assert total["n_remaps"] == 0 and total["hits"] == 0
        else:
            assert total["misses"] > 0 and total["bytes_read"] > 0
            if n_prompt >= 100:  # routes to more distinct experts than the pools hold
                assert total["n_waves"] > total["n_remaps"]  # the prompt ran in waves


def _graph_nodes(capfd, path, **kwargs):
    """The nodes of the graph llama.cpp reserves for a load (its log line), and max_nodes."""
    capfd.readouterr()
    llm = Llama(str(path), n_ctx=N_CTX, verbose=True, **kwargs)
    llm.close()
    err = capfd.readouterr().err
    nodes = re.findall(r"graph(?: \([^)]*\))?: nodes = ([0-9 /]+),", err)
    budget = re.findall(r"max_nodes = (\d+)", err)
    assert nodes and budget, err[-3000:]
    return nodes[-1].strip(), int(budget[-1])


@pytest.mark.parametrize("name", ["qwen3moe-f16", "deepseek2"])
def test_pools_holding_every_expert_run_stocks_graph(fixture_dir, name, capfd):
    """At 100 % slots the pools are preloaded in id order and pinned: the graph is stock's, node
    for node (no remap, guess or substitution op), and no remap is ever called. Paged layers
    below 100 % do add ops (what this measure would show)."""
    path = fixtures.write_fixture(name, fixture_dir)
    stock = _graph_nodes(capfd, path)
    pinned = _graph_nodes(capfd, path, moe_slots="100%", moe_subst=0.5)
    paged = _graph_nodes(capfd, path, moe_slots="50%")
    assert pinned == stock, (pinned, stock)
    assert paged != stock
    llm = Llama(str(path), n_ctx=N_CTX, verbose=False, moe_slots="100%")
    try:
        assert llm.moe_load.pinned
        llm.eval(llm.tokenize(b"The quick brown fox jumps over the lazy dog"))
        total = llm.moe_stats()["total"]
        assert total["n_remaps"] == 0 and total["preloaded"] == total["n_slots"]
    finally:
        llm.close()
    # a trace needs the remap op, and without the preload the pools start empty: not pinned
    for kwargs in (dict(moe_trace=True), dict(moe_preload=False)):
        llm = Llama(str(path), n_ctx=N_CTX, verbose=False, moe_slots="100%", **kwargs)
        try:
            assert not llm.moe_load.pinned
            llm.eval(llm.tokenize(b"The quick brown fox"))
            assert llm.moe_stats()["total"]["n_remaps"] > 0
        finally:
            llm.close()


@pytest.mark.parametrize("name", ["qwen3moe-q4_k", "qwen3moe-q4_0"])
def test_no_repack_is_stock_no_repack(fixture_dir, name, capfd):
    """moe_repack=False loads as llama.cpp's --no-repack: pools of the plain layout (reads land
    in the slots), bit-identical to stock loaded the same way, prompts in waves included."""
    path = fixtures.write_fixture(name, fixture_dir)
    text = b" ".join(b"%d plain pools" % i for i in range(60))

    def run(**kwargs):
        llm = Llama(str(path), n_ctx=N_CTX, logits_all=True, verbose=True, moe_repack=False, **kwargs)
        try:
            logits, tokens = greedy_logits(llm, text, 6)
            return logits, tokens, llm.moe_stats()
        finally:
            llm.close()

    capfd.readouterr()
    got, tokens, stats = run(moe_slots=4, moe_prefetch=0)  # (read-ahead dropped mid-expert bounces its edges)
    err = capfd.readouterr().err
    assert "CPU slot pools size" in err and "CPU_REPACK slot pools" not in err, err[-2000:]
    ref, ref_tokens, _ = run(**{k: v for k, v in stats["exact_kwargs"].items() if k != "moe_repack"})
    assert stats["total"]["n_waves"] > stats["total"]["n_remaps"]  # the prompt ran in waves
    assert tokens == ref_tokens and np.array_equal(got, ref), np.abs(got - ref).max()
    # the stock command that reproduces them (the plan's micro-batch: n_batch = n_ubatch = n_ctx)
    assert stats["exact_to"] == f"llama.cpp --no-repack -b {N_CTX} -ub {N_CTX} -fa on"
    if name == "qwen3moe-q4_k":  # 36 KiB experts: all but the window's edge blocks land in the slots
        assert stats["total"]["bounce_bytes"] <= stats["total"]["bytes_read"] // 9


def test_repack_auto_is_a_rule(fixture_dir, monkeypatch):
    """moe_repack="auto" (the default) resolves at plan time, by rule: stock's defaults where the
    pools hold every expert or none page, plain pools (--no-repack) where they page, the defaults
    again where waves may be masked; True/False force a layout; anything else is refused."""
    from empanel_gguf.planning.plan import resolve_repack

    index = load_index(fixtures.write_fixture("qwen3moe-q4_k", fixture_dir))
    paged, full = plan_slots(index, 4), plan_slots(index, index.n_expert)
    monkeypatch.delenv("EMPANEL_WAVE_MASK", raising=False)
    assert resolve_repack("auto", None) and resolve_repack("auto", full) and not resolve_repack("auto", paged)
    assert resolve_repack(True, paged) and not resolve_repack(False, full)
    monkeypatch.setenv("EMPANEL_WAVE_MASK", "1")
    assert resolve_repack("auto", paged)  # masked waves over plain Q4_K pools are not exact yet
    with pytest.raises(ValueError, match="moe_repack='plain'"):
        resolve_repack("plain", paged)


def test_prefetch_auto_reads_ahead_in_prompts_only(fixture_dir, monkeypatch):
    """moe_prefetch="auto" (the default) resolves at plan time to 0: a decode reads nothing ahead
    (measured slower on the real shapes, docs/performance.md); a number N reads N layers ahead,
    in either layout; anything else is refused. A prompt's waves read the next layer's empty
    slots by rule: where host pools page under a per-layer policy with the guess on, not where
    waves may be masked (a device), the pools hold every expert, g-lru shares the budget or
    nothing guesses; always with N > 0. The load and llama.cpp's plan carry both."""
    from types import SimpleNamespace

    from empanel_gguf.planning.plan import moe_options, plan_load, prompt_ahead, resolve_prefetch

    path = fixtures.write_fixture("qwen3moe-q4_k", fixture_dir)
    index = load_index(path)
    paged, full = plan_slots(index, 4), plan_slots(index, index.n_expert)
    monkeypatch.delenv("EMPANEL_WAVE_MASK", raising=False)
    assert resolve_prefetch("auto") == 0 and resolve_prefetch(0) == 0 and resolve_prefetch(2) == 2
    for bad in ("on", -1, True, 1.5):
        with pytest.raises(ValueError, match="moe_prefetch"):
            resolve_prefetch(bad)

    def ahead(plan, policy="lfu-decay", guess=True, prefetch=0):
        return prompt_ahead(plan, SimpleNamespace(prefetch=prefetch, guess=guess, policy=policy))

    assert ahead(paged) and ahead(paged, "lru")
    assert not ahead(paged, "g-lru") and not ahead(paged, guess=False)
    assert not ahead(full) and not ahead(None)
    assert ahead(full, prefetch=1) and ahead(paged, "g-lru", prefetch=2)
    monkeypatch.setenv("EMPANEL_WAVE_MASK", "1")  # as with a GPU or RPC device: never measured there
    assert not ahead(paged)
    monkeypatch.delenv("EMPANEL_WAVE_MASK")
    for repack in (False, True):
        load = plan_load(index, 4, {}, options=moe_options(moe_repack=repack), guard=False)
        assert load.options.prefetch == 0 and load.pools.params["prefetch"] == 0 and load.pools.guess_depth == 1
        assert load.pools.params["prompt_ahead"] == 1
        load = plan_load(index, 4, {}, options=moe_options(moe_repack=repack, moe_prefetch=1), guard=False)
        assert load.options.prefetch == 1 and load.pools.params["prefetch"] == 1 and load.pools.params["prompt_ahead"] == 1


@pytest.mark.parametrize("moe_batch,n_calls", [("stock", 2), ("auto", 1)])
def test_each_expert_read_once_per_micro_batch(fixture_dir, moe_batch, n_calls):
    """A 700-token prompt through 4 of 16 slots: per layer and micro-batch, misses never exceed
    the distinct experts it routes to (each is read once, not once per wave or per tensor), and
    the bytes read are exactly the misses' experts. At stock's micro-batch the prompt is two
    (512 + 188 tokens); at the plan's (moe_batch "auto") one: each expert is read once per prompt."""
    path = fixtures.write_fixture("qwen3moe-f16", fixture_dir)
    index = load_index(path)
    llm = Llama(str(path), n_ctx=N_CTX, logits_all=True, verbose=False, moe_slots=4, moe_trace=True,
                moe_batch=moe_batch)
    try:
        tokens = prompt_tokens(llm, 700)
        llm.eval(tokens)
        stats = llm.moe_stats()
        trace = llm.moe_take_trace()
    finally:
        llm.close()
    distinct = {}  # layer -> distinct experts summed over its micro-batches
    i = 0
    while i < len(trace):
        layer, n_tok, n_used = int(trace[i]), int(trace[i + 1]), int(trace[i + 2])
        ids = trace[i + 3: i + 3 + n_tok * n_used]
        distinct[layer] = distinct.get(layer, 0) + len(set(ids.tolist()))
        i += 3 + n_tok * n_used
    for il, row in stats["layers"].items():
        assert row["n_remaps"] == n_calls
        assert row["hits"] + row["misses"] == distinct[il]
        # (a micro-batch this large reads ahead into the next layer's empty slots: those land as
        # hits there, or are wasted)
        assert row["bytes_read"] == (row["misses"] + row["prefetched"]) * index.layer(il).expert_bytes
        assert row["prefetch_used"] <= row["hits"]
        assert row["n_waves"] > 2 * 2  # 16 distinct experts, 2 per wave
    assert stats["total"]["misses"] <= sum(distinct.values())


def test_four_sequences_in_one_batch(fixture_dir):
    """Four sequences in one llama_batch (llama-cpp-python's embed() packs them so): the hidden
    states of every token are bit-identical to stock with the same batch."""
    path = fixtures.write_fixture("qwen3moe-q8_0", fixture_dir)
    texts = [b"The quick brown fox", b"jumps over the lazy dog and runs", b"1, 2, 3, 4, 5", b"Once upon a time"]

    def embed(moe_slots, **kwargs):
        llm = Llama(str(path), n_ctx=N_CTX, embedding=True, verbose=False, moe_slots=moe_slots, **kwargs)
        try:
            assert llm.context_params.n_seq_max >= 4
            out = llm.embed([t.decode() for t in texts])
            return [np.array(e) for e in out], llm.moe_stats()
        finally:
            llm.close()

    for moe_slots in (4, "25%", 8):
        got, stats = embed(moe_slots)
        ref, _ = embed(None, **stats["exact_kwargs"])
        assert len(got) == len(ref) == 4
        for g, r in zip(got, ref):
            assert g.shape == r.shape and np.array_equal(g, r)
        t = stats["total"]
        assert t["n_remaps"] == len(stats["layers"])  # one micro-batch of all four sequences
        assert t["n_waves"] > t["n_remaps"]            # that ran in waves


def test_prompts_in_a_row_share_the_pools(fixture_dir):
    """One model, several prompts one after another (reset between): each as from fresh."""
    path = fixtures.write_fixture("qwen3moe-q4_0", fixture_dir)
    spec = fixtures.FIXTURES["qwen3moe-q4_0"]
    llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, moe_slots=spec.n_expert_used)
    ref_llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False)
    try:
        for prompt in (PROMPT,) + OTHER_PROMPTS:
            llm.reset()
            llm.eval(llm.tokenize(prompt))
            got = np.array(llm.scores[: llm.n_tokens], copy=True)
            ref_llm.reset()
            ref = greedy_logits(ref_llm, prompt)[0]
            assert np.array_equal(got, ref)
        assert llm.moe_stats()["total"]["hits"] > 0
    finally:
        llm.close()
        ref_llm.close()


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
        # host pools: the graph never waits for a device to remap
        assert stats["total"]["device_syncs"] == 0 and stats["total"]["tokens"] > 0
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
    path = fixtures.write_fixture("qwen3moe-rss", fixture_dir)
    monkeypatch.setenv("EMPANEL_MEM_AVAILABLE", "64GiB")
    llm = Llama(str(path), n_ctx=128, verbose=False, moe_slots="auto")
    assert llm.moe_stats() is None  # everything fits: every expert resident
    llm.close()

    index = load_index(path)
    floor = host_memory.default_floor()
    full = estimate.estimate(index, None, n_ctx=128).host
    # room for about half of the experts on top of everything else
    available = floor + full - index.expert_bytes_total // 2
    monkeypatch.setenv("EMPANEL_MEM_AVAILABLE", str(available))
    llm = Llama(str(path), n_ctx=128, verbose=False, moe_slots="auto")
    try:
        n_slots = llm.moe_stats()["total"]["n_slots"] // len(index.layers)
        assert index.n_expert_used <= n_slots < index.n_expert
        assert estimate.estimate(index, plan_slots(index, n_slots), n_ctx=128).host <= available - floor
    finally:
        llm.close()


@pytest.mark.parametrize("name", ["qwen3moe-f16", "qwen3moe-f32", "qwen3moe-q4_k"])
def test_masked_waves_bit_identical(fixture_dir, name, monkeypatch):
    """The waves of pools that a GPU kernel may compute on (device memory; plain host memory in a
    build with a GPU backend) are masked: every pair multiplied, each wave's product times its 0/1
    mask added up. EMPANEL_WAVE_MASK=1 treats this build so: its plain host pools (F16, F32) run
    masked waves on the CPU kernels, CPU_REPACK pools (Q4_K where the CPU repacks it) still skip
    pairs. Bit-identical to stock defaults either way."""
    monkeypatch.setenv("EMPANEL_WAVE_MASK", "1")
    path = fixtures.write_fixture(name, fixture_dir)
    spec = fixtures.FIXTURES[name]
    for moe_slots in (spec.n_expert_used, "25%"):
        for n_prompt in (9, 100, 700):
            logits, tokens, stats, _ = run_stock_defaults(path, n_prompt, moe_slots, n_greedy=8)
            ref_logits, ref_tokens, _, _ = baseline(path, n_prompt, stats)
            assert tokens == ref_tokens[:8] and np.array_equal(logits, ref_logits[: len(logits)]), \
                f"{name} {moe_slots} slots, {n_prompt} tokens: max |diff| {np.abs(logits - ref_logits[: len(logits)]).max()}"
            total = stats["total"]
            if n_prompt >= 100:
                assert total["n_waves"] > total["n_remaps"]
            if not name.endswith("q4_k"):  # F16/F32 pools are plain host memory: masked
                assert total["masked_pools"] > 0


@pytest.mark.parametrize("name", ["qwen3moe-q4_k", "deepseek2"])
def test_resident_layers_bit_identical_and_accounted(fixture_dir, name):
    """moe_resident_layers=1: the first MoE layer keeps every expert (no pool, no reads), the
    others page at 25 %; logits equal stock's, and the estimate holds the resident experts."""
    path = fixtures.write_fixture(name, fixture_dir)
    index = load_index(path)
    first = index.moe_layers[0]
    plan = plan_slots(index, "25%", resident_layers=1)
    assert plan.n_slots[first] == 0 and all(plan.n_slots[il] > 0 for il in index.moe_layers[1:])
    assert plan.resident_bytes == index.n_expert * index.layer(first).expert_bytes
    est = estimate.estimate(index, plan, n_ctx=N_CTX)
    assert est.experts == plan.pool_bytes + plan.resident_bytes
    for n_prompt in (9, 100):
        logits, tokens, stats, _ = run_stock_defaults(path, n_prompt, "25%", moe_resident_layers=1)
        ref_logits, ref_tokens, _, _ = baseline(path, n_prompt, stats)
        assert tokens == ref_tokens and np.array_equal(logits, ref_logits)
        assert first not in stats["layers"] and set(stats["layers"]) == set(index.moe_layers[1:])
    # a size pays for the resident layer first
    size = plan.resident_bytes + 4 * sum(layer.expert_bytes for layer in index.layers[1:])
    assert plan_slots(index, f"{size}B", resident_layers=1).min_slots == 4


def test_resident_layers_bad_values(fixture_dir):
    from empanel_gguf.planning.sizing import SlotsError

    index = load_index(fixtures.write_fixture("qwen3moe-q4_k", fixture_dir))
    for bad in (-1, True, len(index.layers)):
        with pytest.raises(SlotsError, match="moe_resident_layers"):
            plan_slots(index, "25%", resident_layers=bad)


GUESS_CASES = [(name, prefetch) for name in fixtures.FIXTURES for prefetch in (0, 1, 2)]


@pytest.mark.parametrize("name,prefetch", GUESS_CASES, ids=[f"{n}-prefetch{p}" for n, p in GUESS_CASES])
def test_guess_and_prefetch_bit_identical(fixture_dir, name, prefetch, monkeypatch):
    """The gate-ahead guess orders eviction (prefetch 0) or also reads ahead (1, 2 layers): what is
    computed never changes. Decode micro-batches fit the pools, so every decoded token is guessed.
    (With prefetch 0 the prompt's own read-ahead of the next layer is off too: nothing is read
    ahead at all.)"""
    if prefetch == 0:
        monkeypatch.setenv("EMPANEL_PROMPT_AHEAD", "0")
    path = fixtures.write_fixture(name, fixture_dir)
    index = load_index(path)
    for n_prompt in (9, 100):
        logits, tokens, stats, _ = run_stock_defaults(path, n_prompt, "25%", moe_prefetch=prefetch)
        ref_logits, ref_tokens, _, _ = baseline(path, n_prompt, stats)
        assert tokens == ref_tokens and np.array_equal(logits, ref_logits), f"{n_prompt} prompt tokens"
        t = stats["total"]
        if len(index.layers) > 1:  # a layer after the first is guessed for every decoded token
            assert t["guess_routed"] > 0 and 0 < t["guess_hits"] <= t["guess_routed"]
        if prefetch and len(index.layers) > 1:
            assert t["prefetched"] > 0 and t["prefetch_used"] <= t["prefetched"]
        else:
            assert t["prefetched"] == 0


@pytest.mark.parametrize("name", ["qwen3moe-q4_k", "qwen3moe-f32", "deepseek2", "gpt-oss"])
def test_decode_reads_overlap_the_compute(fixture_dir, name, monkeypatch):
    """In decode a layer's remap posts its misses and returns; each pool's MUL_MAT_ID first waits
    for its own tensor's reads (empanel_ready), so one tensor's experts compute while the next
    tensor's are read. Plain pools (reads in place) do so, bit-identical to stock --no-repack,
    with read-ahead too, posted in its own lane behind the overlapped reads while they are in
    flight (prefetch_beside), on both read paths; CPU_REPACK pools (stock's defaults, where the
    type has a repacked layout) keep waiting in the remap, bit-identical to stock, and read ahead
    only once nothing else is in flight; EMPANEL_READ_SYNC=1 waits for every read in the remap,
    as before."""
    path = fixtures.write_fixture(name, fixture_dir)
    layered = len(load_index(path).layers) > 1
    for repack in (True, False):
        for prefetch, read_io in ((0, "auto"), (1, "auto"), (1, "threads")):
            logits, tokens, stats, _ = run_stock_defaults(path, 9, "25%", moe_repack=repack, moe_prefetch=prefetch,
                                                          moe_read_io=read_io)
            ref_logits, ref_tokens, _, _ = baseline(path, 9, stats)
            assert tokens == ref_tokens and np.array_equal(logits, ref_logits), (repack, prefetch, read_io)
            t = stats["total"]
            if not repack:  # every decoded token but the first (the ready calls are seen first)
                assert t["overlapped"] >= N_GREEDY // 2, (prefetch, t)
                if prefetch and layered:  # the next layer's guesses queued behind this layer's reads
                    assert t["prefetch_beside"] > 0, (read_io, t)
            elif name == "qwen3moe-q4_k":  # CPU_REPACK pools: the readers repack, no overlap
                assert t["overlapped"] == 0 and t["prefetch_beside"] == 0, (prefetch, t)
            if prefetch and layered:
                assert t["prefetched"] > 0, t
    # EMPANEL_READ_AHEAD_BESIDE=0: a read-ahead waits for the layer's reads to close, as before
    monkeypatch.setenv("EMPANEL_READ_AHEAD_BESIDE", "0")
    logits, tokens, stats, _ = run_stock_defaults(path, 9, "25%", moe_repack=False, moe_prefetch=1)
    assert tokens == ref_tokens and np.array_equal(logits, ref_logits)  # (the plain reference: repack False last)
    assert stats["total"]["prefetch_beside"] == 0, stats["total"]
    if layered:
        assert stats["total"]["prefetched"] > 0, stats["total"]
    monkeypatch.delenv("EMPANEL_READ_AHEAD_BESIDE")
    monkeypatch.setenv("EMPANEL_READ_SYNC", "1")
    logits, tokens, stats, _ = run_stock_defaults(path, 9, "25%")
    ref_logits, ref_tokens, _, _ = baseline(path, 9, stats)
    assert tokens == ref_tokens and np.array_equal(logits, ref_logits)
    assert stats["total"]["overlapped"] == 0


@pytest.mark.parametrize("name", ["qwen3moe-q4_k", "qwen3moe-f32", "deepseek2", "gpt-oss"])
def test_read_ahead_not_routed_is_dropped(fixture_dir, name, monkeypatch):
    """A read-ahead still in flight when its layer's remap comes has the reads of the guessed
    experts the micro-batch does not route to dropped; their slots are emptied, the others land.
    With no reader thread (moe_io_threads=0) nothing is read before the remap, so every wrong
    guess is dropped unread: nothing is wasted and fewer bytes are read than with the whole
    read-ahead kept (EMPANEL_READ_AHEAD_KEEP=1). Logits stay those of stock, repacked and plain."""
    path = fixtures.write_fixture(name, fixture_dir)
    for repack in (True, False):
        runs = {}
        for keep in ("0", "1"):
            monkeypatch.setenv("EMPANEL_READ_AHEAD_KEEP", keep)
            logits, tokens, stats, _ = run_stock_defaults(path, 9, "25%", moe_repack=repack, moe_prefetch=1,
                                                          moe_io_threads=0)
            ref_logits, ref_tokens, _, _ = baseline(path, 9, stats)
            assert tokens == ref_tokens and np.array_equal(logits, ref_logits), (repack, keep)
            runs[keep] = stats["total"]
        dropped, kept = runs["0"], runs["1"]
        assert dropped["prefetched"] > 0 and dropped["prefetch_dropped"] > 0, dropped
        assert dropped["prefetch_wasted"] == 0, dropped
        assert dropped["prefetch_used"] + dropped["prefetch_dropped"] <= dropped["prefetched"], dropped
        assert kept["prefetch_dropped"] == 0 and kept["prefetch_wasted"] > 0, kept
        assert dropped["bytes_read"] < kept["bytes_read"], (dropped["bytes_read"], kept["bytes_read"])


def test_guess_off_makes_no_guesses(fixture_dir):
    path = fixtures.write_fixture("qwen3moe-q4_k", fixture_dir)
    logits, tokens, stats, _ = run_stock_defaults(path, 9, "25%", moe_guess=False)
    ref_logits, ref_tokens, _, _ = baseline(path, 9, stats)
    assert tokens == ref_tokens and np.array_equal(logits, ref_logits)
    assert stats["total"]["guessed"] == 0 and stats["total"]["guess_recall"] == 0.0


def test_glru_reads_ahead_with_a_full_budget(fixture_dir):
    """g-lru with a full budget reads ahead into the guessed layer's own least recent slots (no
    other layer's expert goes): read-ahead keeps running for the whole decode, logits exact."""
    path = fixtures.write_fixture("qwen3moe-f32", fixture_dir)
    logits, tokens, stats, _ = run_stock_defaults(path, 9, 4, n_greedy=32, moe_policy="g-lru", moe_prefetch=1)
    ref_logits, ref_tokens, _, _ = run_stock_defaults(path, 9, None, n_greedy=32, **stock_kwargs(stats))
    assert tokens == ref_tokens and np.array_equal(logits, ref_logits)
    t = stats["total"]
    # a budget of 4 experts per layer is full after the prompt; most decoded tokens still read ahead
    assert t["prefetched"] >= 32 and t["prefetch_used"] > 0


def test_substitution_changes_outputs_only_when_on(fixture_dir):
    """moe_subst is opt-in and inexact: on, stand-ins are used and the logits move; the same
    run without it is stock's bit for bit. `kl` reports 0 when it is off."""
    from empanel_gguf.commands.kl import compare

    path = fixtures.write_fixture("qwen3moe-f32", fixture_dir)
    exact, exact_tokens, stats, _ = run_stock_defaults(path, 9, 4, n_greedy=24)
    ref, ref_tokens, _, _ = run_stock_defaults(path, 9, None, n_greedy=24, **stock_kwargs(stats))
    assert np.array_equal(exact, ref) and stats["total"]["substituted"] == 0
    approx, _, stats, _ = run_stock_defaults(path, 9, 4, n_greedy=24, moe_subst=0.3)
    assert stats["total"]["substituted"] > 0 and not np.array_equal(approx, ref)
    text = LONG_TEXT.decode()
    off = compare(path, text, 64, 4, None)
    assert off["kl_mean"] == 0.0 and off["top1_agree"] == 1.0 and off["substituted"] == 0
    on = compare(path, text, 64, 4, 0.3)
    assert on["kl_mean"] > 0 and on["substituted"] > 0 and on["bytes_subst"] < on["bytes_exact"]
    for bad in (0, 1.5, True, "x"):
        with pytest.raises(ValueError, match="moe_subst"):
            Llama(str(path), moe_slots=4, moe_subst=bad, verbose=False)
