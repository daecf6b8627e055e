"""A live budget (csrc/budget.c, Llama.moe_set_budget) under every policy: the pools give memory
back and take it again while the model runs, and the logits stay bit-identical to stock
throughout, in a decode and in a prompt's waves."""

import os
import random
import subprocess
import sys
import threading
import time

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


def stock_logits(path, exact_to, steps=None, tokens=None, **kwargs):
    """Stock llama.cpp in the layout the pools name: decode(steps) or the logits of `tokens`."""
    stock = Llama(str(path), logits_all=True, verbose=False, moe_repack=exact_to != "llama.cpp --no-repack",
                  **kwargs)
    try:
        if tokens is not None:
            stock.eval(tokens)
            return np.array(stock.scores[: stock.n_tokens], copy=True)
        return decode(stock, steps)[0]
    finally:
        stock.close()


@pytest.mark.parametrize("name,policy", [("qwen3moe-q4_0", "lfu-decay"), ("qwen3moe-q8_0", "lru"),
                                         ("qwen3moe-q8_0", "g-lru")])
def test_budget_moves_mid_decode_exactly(tmp_path, name, policy):
    """Shrink to the floor in the middle of a decode, then grow back: the memory held follows the
    budget at once, and every logit equals stock's in the layout the run names."""
    path = fixtures.write_fixture(name, tmp_path)
    index = load_index(path)
    llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, moe_slots=index.n_expert // 2,
                moe_policy=policy)
    try:
        start = llm.moe_stats()["budget"]
        floor, planned = start["floor_bytes"], start["budget_bytes"]
        assert floor == sum(index.n_expert_used * layer.expert_bytes for layer in index.layers)
        assert planned >= 2 * floor and not start["fixed"] and not start["elastic"]
        logits, seen = decode(llm, [(None, 6), (floor, 6), (planned, 6)])
        stats = llm.moe_stats()
    finally:
        llm.close()
    shrunk, grown = seen
    assert shrunk["budget_bytes"] == floor and shrunk["resident_bytes"] <= floor   # given back at once
    assert shrunk["given_back_bytes"] > 0 and shrunk["lowest_bytes"] == floor
    assert grown["budget_bytes"] == planned and stats["budget"]["n_changes"] == 2
    assert stats["budget"]["resident_bytes"] > floor                               # taken again as read
    assert np.array_equal(logits, stock_logits(path, stats["exact_to"], [(None, 18)], n_ctx=256))


def test_budget_moves_during_a_prompt_exactly(tmp_path):
    """A thread moves the budget at random, floor to capacity, while a long prompt runs in
    micro-batches of 16 tokens that route to more experts than the slots (waves): every logit
    equals stock's, whatever the budget was at each remap."""
    path = fixtures.write_fixture("qwen3moe-q8_0", tmp_path)
    index = load_index(path)
    llm = Llama(str(path), n_ctx=512, n_batch=256, n_ubatch=16, logits_all=True, verbose=False,
                moe_slots=index.n_expert_used + 2)
    tokens = [(13 * t + 5) % 250 + 1 for t in range(200)]
    stop = threading.Event()
    moves = []

    def move():
        budget = llm.moe_stats()["budget"]
        rng = random.Random(7)
        while not stop.is_set():
            size = rng.randint(budget["floor_bytes"], budget["capacity_bytes"])
            llm.moe_set_budget(size)
            moves.append(size)
            stop.wait(0.002)

    mover = threading.Thread(target=move)
    try:
        mover.start()
        llm.eval(tokens)
        stop.set()
        mover.join()
        logits = np.array(llm.scores[: llm.n_tokens], copy=True)
        stats = llm.moe_stats()
    finally:
        stop.set()
        llm.close()
    assert len(moves) > 10 and stats["budget"]["n_changes"] >= 10 and stats["total"]["n_waves"] > stats["total"]["n_remaps"]
    expected = stock_logits(path, stats["exact_to"], tokens=tokens, n_ctx=512, n_batch=256, n_ubatch=16)
    assert np.array_equal(logits, expected)


def test_budget_is_refused_where_it_cannot_hold(tmp_path):
    path = fixtures.write_fixture("qwen3moe-q8_0", tmp_path)
    index = load_index(path)
    llm = Llama(str(path), n_ctx=64, verbose=False, moe_slots=index.n_expert // 2)
    try:
        floor = llm.moe_stats()["budget"]["floor_bytes"]
        with pytest.raises(ValueError, match="below the floor"):
            llm.moe_set_budget(floor - 1)
        with pytest.raises(ValueError, match="give a size"):
            llm.moe_set_budget("lots")
        llm.moe_set_budget(f"{floor}")  # bytes as text: a size too
        llm.moe_set_budget("1TiB")      # above the capacity: every slot
        budget = llm.moe_stats()["budget"]
        assert budget["budget_bytes"] == budget["capacity_bytes"]
    finally:
        llm.close()
    pinned = Llama(str(path), n_ctx=64, verbose=False, moe_slots=index.n_expert, moe_elastic=True)
    try:
        assert pinned.moe_stats()["budget"]["fixed"] and not pinned.moe_stats()["budget"]["elastic"]
        with pytest.raises(ValueError, match="cannot give memory back: pinned"):
            pinned.moe_set_budget("1MiB")
    finally:
        pinned.close()
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
llm = Llama(str(path), n_ctx=128, verbose=False, moe_slots=64)
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
    floor = sum(index.n_expert_used * layer.expert_bytes for layer in index.layers)
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path), str(floor)], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    line = [text for text in proc.stdout.splitlines() if text.startswith("RSSANON")]
    assert line, proc.stderr[-2000:]
    rss_before, resident_before, rss_after, resident_after = (int(x) for x in line[0].split()[1:])
    assert resident_after <= floor < resident_before
    assert rss_before - rss_after >= 0.7 * (resident_before - resident_after), (rss_before, rss_after)


def machine_memory():
    """Bytes of memory and swap (MemTotal + SwapTotal): what the kernel's overcommit heuristic
    compares one allocation with."""
    info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.split()[1:]}
    return info["MemTotal"] + info.get("SwapTotal", 0)


@pytest.mark.parametrize("qtype,repack", [("F16", False), ("Q4_0", True)])
def test_capacity_beyond_memory(tmp_path, qtype, repack):
    """Pools whose capacity (their slots' address space) is larger than the machine's memory and
    swap load and decode under a budget: host pools, plain and CPU_REPACK alike, are reserved
    without commit (llama-empanel-pools.cpp; patch 0003 makes the repacked buffer over the range),
    which the overcommit heuristic does not refuse as it refuses one allocation of that size, and
    only the slots filled take memory. The experts are holes in a sparse file (zeros: a model
    larger than memory on no disk); the logits equal those of a small pool of the same file, which
    the other tests hold equal to stock's."""
    n_ff = 65536 if qtype == "F16" else 4 * 65536
    expert = 3 * 256 * n_ff * (2 if qtype == "F16" else 18 / 32)  # bytes of one expert [256, n_ff] x 3 (96 / 108 MiB)
    expert = int(expert)
    n_expert = -(-int(1.25 * machine_memory()) // expert) + 8
    spec = fixtures.FixtureSpec(f"qwen3moe-holes-{qtype}", "qwen3moe", n_layer=1, n_expert=n_expert, n_expert_used=2,
                                n_embd=256, n_ff_exp=n_ff, weight_type="F16", expert_types=(qtype,),
                                expert_holes=True, seed=21)
    path = fixtures.write_model(spec, tmp_path / "holes.gguf")
    assert os.stat(path).st_blocks * 512 < 64 << 20  # (sparse: the experts take no disk)
    capacity = (n_expert - 8) * expert
    assert capacity > machine_memory()
    sanitizer = os.environ.get("EMPANEL_SANITIZER")  # (its allocator answers malloc; its shadow adds to RSS)
    if open("/proc/sys/vm/overcommit_memory").read().strip() == "0" and not sanitizer:
        # the heuristic refuses one allocation of the capacity: what the pools were before
        import ctypes
        libc, ptr = ctypes.CDLL(None), ctypes.c_void_p()
        assert libc.posix_memalign(ctypes.byref(ptr), 4096, ctypes.c_size_t(capacity)) != 0
    tokens = [(5 * t + 11) % 200 + 1 for t in range(12)]
    logits = {}
    for slots, budget in ((n_expert - 8, 4 * expert), (4, None)):
        llm = Llama(str(path), n_ctx=64, logits_all=True, verbose=False, moe_slots=slots, moe_budget=budget,
                    moe_repack=repack)
        try:
            assert llm.moe_stats()["exact_to"] == ("llama.cpp with its defaults" if repack else "llama.cpp --no-repack")
            llm.eval(tokens[:8])  # (a prompt's waves may fill the layer past the budget: the next remap trims)
            for token in tokens[8:]:
                llm.eval([token])
            logits[slots] = np.array(llm.scores[: llm.n_tokens], copy=True)
            stats = llm.moe_stats()["budget"]
            if budget is not None:
                assert stats["capacity_bytes"] == capacity and stats["budget_bytes"] == budget
                assert stats["resident_bytes"] <= budget and llm.moe_stats()["total"]["misses"] > 0
                rss = int([line for line in open("/proc/self/status") if line.startswith("VmRSS")][0].split()[1])
                assert sanitizer or rss * 1024 < 4 << 30
        finally:
            llm.close()
    assert np.array_equal(logits[n_expert - 8], logits[4])


def test_a_move_down_does_not_wait_for_the_preload(tmp_path):
    """The preload lets go of the pool's lock between chunks of 32 MiB (63-3): a budget set while
    it reads (288 MiB from the drive, O_DIRECT) returns before the preload ends, the preload stops
    at the lower budget, and decoding after it is bit-identical to stock."""
    from empanel_gguf.models.fixtures import FixtureSpec, write_model

    spec = FixtureSpec("preload-lock", "qwen3moe", n_layer=2, n_expert=64, n_expert_used=4, n_embd=1024,
                       n_ff_exp=512, weight_type="F16", expert_types=("F16", "F16"), seed=22)
    path = write_model(spec, tmp_path / "preload.gguf")
    llm = Llama(str(path), n_ctx=64, logits_all=True, verbose=False, moe_slots=48, moe_preload=False)
    try:
        floor = llm.moe_stats()["budget"]["floor_bytes"]
        done = {}

        def preload():
            experts = llm._experts  # (preload() reads only where the plan says so: the sidecar's own call)
            done["n"] = experts.n.sidecar.empanel_preload(experts.pool)
            done["at"] = time.monotonic()

        thread = threading.Thread(target=preload)
        thread.start()
        t0 = time.monotonic()  # the preload has read its first chunk (a fixed sleep raced it under TSan)
        while llm.moe_stats()["budget"]["resident_bytes"] == 0 and time.monotonic() - t0 < 10:
            time.sleep(0.001)
        llm.moe_set_budget(floor)
        set_at = time.monotonic()
        thread.join()
        budget = llm.moe_stats()["budget"]
        assert set_at < done["at"], (set_at, done)  # (before: the set waited for the whole preload)
        assert budget["budget_bytes"] == floor and budget["resident_bytes"] <= floor, budget
        assert 0 < done["n"] < 96, done
        logits, _ = decode(llm, [(None, 4)])
        exact_to = llm.moe_stats()["exact_to"]
    finally:
        llm.close()
    assert np.array_equal(logits, stock_logits(path, exact_to, [(None, 4)], n_ctx=64))


def test_a_move_down_does_not_wait_for_reads_in_flight(tmp_path, monkeypatch, read_io):
    """A budget set while a read is in flight returns without waiting for it (63-3/4): every read
    request starts 250 ms late (EMPANEL_FAULT_READ_DELAY_MS, a slow drive), the preload reads its
    first layer, and a move down 100 ms into it returns within 150 ms, long before the preload
    ends (before: it waited for the layer's reads, ~250 ms and more, holding the pool's lock).
    Decoding after it is bit-identical to stock."""
    from empanel_gguf.models.fixtures import FixtureSpec, write_model

    spec = FixtureSpec("read-lock", "qwen3moe", n_layer=2, n_expert=8, n_expert_used=2, weight_type="Q8_0", seed=24)
    path = write_model(spec, tmp_path / "slow-reads.gguf")
    monkeypatch.setenv("EMPANEL_FAULT_READ_DELAY_MS", "250")
    llm = Llama(str(path), n_ctx=64, logits_all=True, verbose=False, moe_slots=4, moe_preload=False)
    try:
        floor = llm.moe_stats()["budget"]["floor_bytes"]
        done = {}

        def preload():
            experts = llm._experts
            done["n"] = experts.n.sidecar.empanel_preload(experts.pool)
            done["at"] = time.monotonic()

        thread = threading.Thread(target=preload)
        t0 = time.monotonic()
        thread.start()
        time.sleep(0.1)  # (the preload's first read waits 250 ms; were it not started yet, the set is fast anyway)
        before = time.monotonic()
        llm.moe_set_budget(floor)
        took = time.monotonic() - before
        thread.join()
        assert took < 0.15 and before + took < done["at"], (took, before - t0, done["at"] - t0)
        assert done["n"] > 0 and done["at"] - t0 >= 0.25, done
        monkeypatch.delenv("EMPANEL_FAULT_READ_DELAY_MS")  # (read once, at load: the decode's reads wait too)
        logits, _ = decode(llm, [(None, 2)])
        exact_to = llm.moe_stats()["exact_to"]
    finally:
        llm.close()
    assert np.array_equal(logits, stock_logits(path, exact_to, [(None, 2)], n_ctx=64))


def test_a_move_down_left_owing_spares_the_next_hits(tmp_path):
    """A move down that must leave the busy layer's slots (the layer computing now) is paid at the
    layer's next remap, after that micro-batch's hits are marked (63-7): no expert routed there
    that was resident is evicted and read again. One MoE layer, so that the layer computing now
    and the next remap's layer are the same; three rounds of a 3-token batch (its experts all
    busy), the budget cut to the floor, then one token."""
    from empanel_gguf.models.fixtures import FixtureSpec, write_model

    spec = FixtureSpec("owing-spares-hits", "qwen3moe", n_layer=1, n_expert=16, n_expert_used=4,
                       weight_type="Q8_0", seed=23)
    path = write_model(spec, tmp_path / "one-layer.gguf")
    llm = Llama(str(path), n_ctx=128, logits_all=True, verbose=False, moe_slots=12)
    overlap = 0
    try:
        budget = llm.moe_stats()["budget"]
        floor, capacity = budget["floor_bytes"], budget["capacity_bytes"]
        layer = next(iter(llm.moe_stats()["layers"]))
        tokens = llm.tokenize(PROMPT)
        for batch in (tokens[:3], tokens[3:6], tokens[6:9]):
            llm.moe_set_budget(capacity)
            llm.eval(batch)
            llm.moe_set_budget(floor)
            held = {e for e in llm._experts.slot_table(layer) if e >= 0}  # the batch's, busy
            left = llm.moe_stats()["budget"]
            assert left["resident_bytes"] > floor  # the busy slots stayed: the move is owed
            misses = llm.moe_stats()["total"]["misses"]
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
            after = llm.moe_stats()
            routed = {e for e in llm._experts.slot_table(layer) if e >= 0}
            assert len(routed) == spec.n_expert_used and after["budget"]["resident_bytes"] <= floor
            overlap += len(routed & held)
            # only the routed experts that were not held are read
            assert after["total"]["misses"] - misses == len(routed - held), (routed, held)
        logits = np.array(llm.scores[: llm.n_tokens], copy=True)
        exact_to, ids = llm.moe_stats()["exact_to"], [int(t) for t in llm._input_ids[: llm.n_tokens]]
    finally:
        llm.close()
    assert overlap > 0  # (the check has teeth: held experts were routed again)
    stock = Llama(str(path), n_ctx=128, logits_all=True, verbose=False, moe_repack=exact_to != "llama.cpp --no-repack")
    try:
        for at in range(0, len(ids), 4):  # the same batches: 3 tokens, then 1
            stock.eval(ids[at:at + 3])
            stock.eval(ids[at + 3:at + 4])
        assert np.array_equal(logits, np.array(stock.scores[: stock.n_tokens]))
    finally:
        stock.close()


def test_the_budget_is_exceeded_by_busy_and_reading_layers_at_most(tmp_path):
    """A move down keeps what it may not empty now (63-5): the slots of the layer computing now and
    of the layers whose reads are in flight (they would land in released pages; read-ahead is one
    of them). So the budget can be exceeded by at most those layers' pools: the layer computing
    now and one per read lane. A thread moves the budget at random while a decode reads two layers
    ahead; max_over_bytes, the most it was exceeded, stays within that, and the logits equal
    stock's."""
    path = fixtures.write_fixture("qwen3moe-q8_0", tmp_path)
    index = load_index(path)
    llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, moe_slots=8, moe_policy="lru",
                moe_prefetch=2)
    stop = threading.Event()

    def move():
        budget = llm.moe_stats()["budget"]
        rng = random.Random(11)
        while not stop.is_set():
            llm.moe_set_budget(rng.choice([budget["floor_bytes"], budget["capacity_bytes"]]))
            stop.wait(0.0005)

    mover = threading.Thread(target=move)
    try:
        mover.start()
        logits, _ = decode(llm, [(None, 40)])
        stop.set()
        mover.join()
        stats = llm.moe_stats()
    finally:
        stop.set()
        llm.close()
    pool_bytes = max(8 * layer.expert_bytes for layer in index.layers)
    over = stats["budget"]["max_over_bytes"]
    assert stats["total"]["prefetched"] > 0 and stats["budget"]["n_changes"] > 10
    assert over <= (1 + 2) * pool_bytes, (over, pool_bytes)  # the layer computing now, 2 read lanes
    assert np.array_equal(logits, stock_logits(path, stats["exact_to"], [(None, 40)], n_ctx=256))
