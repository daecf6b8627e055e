"""The controller (csrc/pressure.c, moe_elastic): it reads the memory left where the planner says
(planning/host_memory.py, the one definition) and moves the live budget: down at once when
memory runs low, up again once it is free, without swinging. Fake cgroup trees stand for the
kernel's files here; tests/test_neighbour.py runs a real cgroup with a real neighbour."""

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.engine.native import native
from empanel_gguf.engine.pools import memory_sources_c
from empanel_gguf.models import fixtures
from empanel_gguf.planning import host_memory
from empanel_gguf.planning.index import load_index
from empanel_gguf.planning.plan import moe_options, plan_load

MiB = 1 << 20


def cgroup_v1(tmp_path, limit, usage, inactive):
    d = tmp_path / "v1"
    d.mkdir(exist_ok=True)
    (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (d / "memory.stat").write_text(f"cache 4096\nrss 8192\ninactive_file 1\ntotal_cache 4096\n"
                                   f"total_inactive_file {inactive}\ntotal_active_file 77\n")
    return {"limit": str(d / "memory.limit_in_bytes"), "usage": str(d / "memory.usage_in_bytes"),
            "stat": str(d / "memory.stat"), "stat_key": "total_inactive_file"}


def cgroup_v2(tmp_path, limit, current, inactive):
    d = tmp_path / "v2"
    d.mkdir(exist_ok=True)
    (d / "memory.max").write_text(f"{limit}\n")
    (d / "memory.current").write_text(f"{current}\n")
    (d / "memory.stat").write_text(f"anon 100\nfile 300\nactive_file 200\ninactive_file {inactive}\n")
    return {"limit": str(d / "memory.max"), "usage": str(d / "memory.current"), "stat": str(d / "memory.stat"),
            "stat_key": "inactive_file"}


def meminfo(tmp_path, available_kb):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       16000000 kB\nMemFree:         100 kB\nMemAvailable:   {available_kb} kB\n"
                    "Buffers:           0 kB\n")
    return {"available": str(path), "available_key": "MemAvailable"}


def memory_available(sources):
    """The memory `sources` leave as the sidecar's controller reads them (bytes; None: none could
    be read)."""
    n = native()
    structs, keep = memory_sources_c(n, sources)
    left = n.sidecar.empanel_memory_available(structs, len(sources))
    return None if left == (1 << 64) - 1 else left


def python_left(sources):
    values = [v for v in (host_memory.source_left(s) for s in sources) if v is not None]
    return min(values) if values else None


def test_the_sidecar_reads_memory_as_the_planner_does(tmp_path):
    """C's reading (the controller's) and Python's (the planner's) of the same files agree, on
    cgroup v1 and v2 trees, a v2 limit of "max", meminfo, and this machine's own sources."""
    v1 = cgroup_v1(tmp_path, 6 << 30, 5 << 30, 300 * MiB)
    v2 = cgroup_v2(tmp_path, 2 << 30, 1 << 30, 64 * MiB)
    host = meminfo(tmp_path, 3_000_000)
    for sources in ([v1], [v2], [host], [v1, v2, host], [v2, host]):
        assert memory_available(sources) == python_left(sources)
    assert memory_available([v1]) == (6 << 30) - (5 << 30) + 300 * MiB
    assert memory_available([v1, v2, host]) == (1 << 30) + 64 * MiB
    Path(v2["limit"]).write_text("max\n")
    assert memory_available([v2]) is None and python_left([v2]) is None
    assert memory_available([v2, host]) == 3_000_000 * 1024
    Path(v1["usage"]).write_text(f"{7 << 30}\n")  # over the limit (the kernel reclaims): nothing left
    assert memory_available([v1]) == 0 == python_left([v1])
    # v2's memory.high is a limit too: the lower of it and memory.max binds (63-2)
    Path(v2["limit"]).write_text(f"{2 << 30}\n")
    high = Path(v2["limit"]).with_name("memory.high")
    high.write_text(f"{1536 * MiB}\n")
    v2h = dict(v2, high=str(high))
    assert memory_available([v2h]) == python_left([v2h]) == 512 * MiB + 64 * MiB
    high.write_text("max\n")
    assert memory_available([v2h]) == python_left([v2h]) == (1 << 30) + 64 * MiB
    real = host_memory.memory_sources()
    if real:
        assert abs(memory_available(real) - python_left(real)) < 64 * MiB  # (read a moment apart)


def test_the_controller_gives_back_and_takes_again(tmp_path):
    """Usage rises past the reserve: the budget drops at once and the pages go; decoding goes on
    bit-identical to stock; usage falls: the budget is back within 5 s and then holds still."""
    path = fixtures.write_fixture("qwen3moe-rss", tmp_path)
    index = load_index(path)
    limit, reserve = 4 << 30, 64 * MiB
    source = cgroup_v1(tmp_path, limit, 1 << 30, 0)
    llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, moe_slots=128, moe_elastic=False)
    tokens = []
    try:
        llm.eval(llm.tokenize(b"The quick brown fox"))
        for _ in range(8):
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(tokens[-1:])
        before = llm.moe_stats()["budget"]
        capacity = before["capacity_bytes"]
        assert before["budget_bytes"] == capacity and before["resident_bytes"] > capacity // 2
        llm._experts.watch_memory([source], reserve, interval_ms=10)
        time.sleep(0.1)
        assert llm.moe_stats()["budget"]["n_changes"] == 0  # plenty left: nothing moves
        # another program takes memory: 16 MiB left, below the reserve
        Path(source["usage"]).write_text(f"{limit - 16 * MiB}\n")
        t0 = time.monotonic()
        while llm.moe_stats()["budget"]["n_shrinks"] == 0 and time.monotonic() - t0 < 5:
            time.sleep(0.002)
        seen_after = time.monotonic() - t0
        low = llm.moe_stats()["budget"]
        assert low["n_shrinks"] >= 1 and seen_after < 0.5, seen_after
        want = max(low["floor_bytes"], before["resident_bytes"] - (reserve - 16 * MiB) - reserve // 2)
        assert low["budget_bytes"] == want and low["resident_bytes"] <= want
        assert low["available_bytes"] == 16 * MiB and low["last_shrink_ms"] < 100
        for _ in range(8):  # decoding under the lower budget
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(tokens[-1:])
        assert llm.moe_stats()["budget"]["resident_bytes"] <= want + capacity // len(index.layers)
        # the program leaves: back to the capacity within 5 s, and no swinging after
        Path(source["usage"]).write_text(f"{1 << 30}\n")
        t0 = time.monotonic()
        while llm.moe_stats()["budget"]["budget_bytes"] < capacity and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        back_after = time.monotonic() - t0
        assert llm.moe_stats()["budget"]["budget_bytes"] == capacity and back_after < 5, back_after
        settled = llm.moe_stats()["budget"]
        time.sleep(1.0)
        assert llm.moe_stats()["budget"]["n_changes"] == settled["n_changes"]
        assert settled["n_grows"] >= 1 and settled["lowest_bytes"] == want
        for _ in range(8):
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(tokens[-1:])
        logits = np.array(llm.scores[: llm.n_tokens], copy=True)
        exact_to = llm.moe_stats()["exact_to"]
    finally:
        llm.close()
    stock = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, moe_repack=exact_to != "llama.cpp --no-repack")
    try:
        stock.eval(stock.tokenize(b"The quick brown fox"))
        for token in tokens:  # one at a time, as the pools ran (a batch takes other kernels)
            stock.eval([token])
        assert np.array_equal(logits, np.array(stock.scores[: stock.n_tokens]))
    finally:
        stock.close()


def test_elastic_follows_the_options(tmp_path, monkeypatch):
    """moe_slots="auto" pools that page are elastic by default; a count is not unless asked;
    moe_elastic=False pins auto; EMPANEL_MEM_AVAILABLE (the measurement replaced) turns the
    default off. The plan names the files it watches, and the pools watch them."""
    path = fixtures.write_fixture("qwen3moe-rss", tmp_path)
    index = load_index(path)
    full = plan_load(index, None, {"n_ctx": 64}, available=1 << 40, floor=0).estimate.host  # every expert
    floor, paging = 128 * MiB, 128 * MiB + full - index.expert_bytes_total // 2  # available: auto pages
    for slots, elastic, on in (("auto", None, True), (64, None, False), (64, True, True), ("auto", False, False)):
        load = plan_load(index, slots, {"n_ctx": 64}, options=moe_options(moe_elastic=elastic), available=paging,
                         floor=floor, guard=False)
        assert load.plan is not None and (load.controller is not None) is on, (slots, elastic)
        if on:
            assert load.controller["sources"] == host_memory.memory_sources()
            assert load.controller["reserve"] == max(load.floor // 2, 64 * MiB)
            llm = Llama(str(path), n_ctx=64, verbose=False, moe_load=load)
            try:
                budget = llm.moe_stats()["budget"]
                assert budget["elastic"] and budget["reserve_bytes"] == load.controller["reserve"]
            finally:
                llm.close()
    monkeypatch.setenv("EMPANEL_MEM_AVAILABLE", str(paging))
    load = plan_load(index, "auto", {"n_ctx": 64}, available=paging, floor=floor, guard=False)
    assert load.plan is not None and load.controller is None


def decode(llm, tokens, n):
    for _ in range(n):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(tokens[-1:])


def wait_for(check, timeout=5.0):
    t0 = time.monotonic()
    while not check() and time.monotonic() - t0 < timeout:
        time.sleep(0.005)
    return check()


def test_a_budget_the_app_sets_is_a_ceiling(tmp_path):
    """moe_set_budget is where the controller stops growing: plenty free, and 3 s later the budget
    is still the one set (63-8); a higher one set raises it again."""
    path = fixtures.write_fixture("qwen3moe-rss", tmp_path)
    source = cgroup_v1(tmp_path, 64 << 30, 1 << 30, 0)
    llm = Llama(str(path), n_ctx=256, verbose=False, moe_slots=128, moe_elastic=False)
    try:
        llm.eval(llm.tokenize(b"The quick brown fox"))
        decode(llm, [], 4)
        capacity = llm.moe_stats()["budget"]["capacity_bytes"]
        llm._experts.watch_memory([source], 64 * MiB, interval_ms=10)
        llm.moe_set_budget(capacity // 2)
        time.sleep(3.0)  # (moves up come 2 s after a move down, every 0.5 s)
        budget = llm.moe_stats()["budget"]
        assert budget["budget_bytes"] == budget["ceiling_bytes"] == capacity // 2, budget
        # less memory now: the controller goes below the ceiling, and back up to it, not past it
        Path(source["usage"]).write_text(f"{(64 << 30) - 16 * MiB}\n")
        assert wait_for(lambda: llm.moe_stats()["budget"]["budget_bytes"] < capacity // 2)
        Path(source["usage"]).write_text(f"{1 << 30}\n")
        assert wait_for(lambda: llm.moe_stats()["budget"]["budget_bytes"] == capacity // 2, 10)
        time.sleep(1.0)
        assert llm.moe_stats()["budget"]["budget_bytes"] == capacity // 2
        llm.moe_set_budget(capacity)
        assert llm.moe_stats()["budget"]["ceiling_bytes"] == capacity
    finally:
        llm.close()


def test_a_long_deficit_at_the_floor_polls_at_its_interval(tmp_path):
    """A deficit larger than one move down's most (768 MiB) is given back in steps, the next poll
    at once; once the budget is at the floor nothing more is owed, and the controller goes back to
    its interval instead of polling in a loop (a core at 100 % for as long as memory stays low)."""
    path = fixtures.write_fixture("qwen3moe-rss", tmp_path)
    limit = 8 << 30
    source = cgroup_v1(tmp_path, limit, limit, 0)  # nothing left: a deficit of 1.5 reserves
    llm = Llama(str(path), n_ctx=256, verbose=False, moe_slots=128, moe_elastic=False)
    try:
        llm.eval(llm.tokenize(b"The quick brown fox"))
        decode(llm, [], 4)
        llm._experts.watch_memory([source], 1 << 30, interval_ms=20)
        assert wait_for(lambda: llm.moe_stats()["budget"]["budget_bytes"] == llm.moe_stats()["budget"]["floor_bytes"])
        time.sleep(0.2)
        cpu = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - cpu < 0.3  # (a poll every 20 ms costs microseconds)
    finally:
        llm.close()


def test_a_source_that_cannot_be_read_is_left_out(tmp_path, capfd):
    """A named file that cannot be opened leaves that source out, not the controller (63-4): the
    others are watched; a file that goes away at run time is counted (n_unread) and said once on
    stderr, and the budget still moves with the source that reads."""
    path = fixtures.write_fixture("qwen3moe-rss", tmp_path)
    good = cgroup_v1(tmp_path, 4 << 30, 1 << 30, 0)
    gone = {"limit": str(tmp_path / "nowhere" / "memory.limit_in_bytes"), "usage": str(tmp_path / "nowhere" / "u"),
            "stat": "", "stat_key": ""}
    (tmp_path / "later").mkdir()
    later = cgroup_v1(tmp_path / "later", 8 << 30, 1 << 30, 0)
    llm = Llama(str(path), n_ctx=256, verbose=False, moe_slots=128, moe_elastic=False)
    try:
        llm.eval(llm.tokenize(b"The quick brown fox"))
        decode(llm, [], 4)
        llm._experts.watch_memory([gone, good, later], 64 * MiB, interval_ms=10)
        assert llm.moe_stats()["budget"]["elastic"]
        Path(later["usage"]).write_text("")  # unreadable from now on (as a removed cgroup's files)
        assert wait_for(lambda: llm.moe_stats()["budget"]["n_unread"] >= 3)
        Path(good["usage"]).write_text(f"{(4 << 30) - 16 * MiB}\n")
        assert wait_for(lambda: llm.moe_stats()["budget"]["n_shrinks"] >= 1)
        assert llm.moe_stats()["budget"]["available_bytes"] == 16 * MiB
    finally:
        llm.close()
    err = capfd.readouterr().err
    assert "cannot open " + gone["limit"] in err and err.count("cannot read " + later["limit"]) == 1, err


def test_a_reserve_is_bounded(tmp_path):
    """A reserve of 0 would never give back and one near 2^64 overflows the controller's arithmetic
    (63-9): both refused, by the sidecar and in a plan file."""
    path = fixtures.write_fixture("qwen3moe-rss", tmp_path)
    source = cgroup_v1(tmp_path, 4 << 30, 1 << 30, 0)
    llm = Llama(str(path), n_ctx=64, verbose=False, moe_slots=128, moe_elastic=False)
    try:
        for reserve in (0, 1 << 63):
            with pytest.raises(ValueError, match="keeping"):
                llm._experts.watch_memory([source], reserve, interval_ms=10)
        assert not llm.moe_stats()["budget"]["elastic"]
    finally:
        llm.close()


def test_two_pools_give_back_one_shortfall_once(tmp_path):
    """Two models in one process watch the same memory: when it runs short, one of them gives the
    shortfall back and the other, seeing a move of this process whose pages are not in its reading
    yet, waits for the next reading instead of cutting for the same shortfall (63-6: the time of
    that move is compared without wrapping when the other pool stored a later one). A thread plays
    the kernel: the pages given back come off the usage 12 ms later, within both pools' next poll
    (every 20 ms)."""
    path = fixtures.write_fixture("qwen3moe-rss", tmp_path)
    limit, reserve = 4 << 30, 4 * MiB
    used = limit - 1 * MiB  # a shortfall of 3 MiB: a cut of 5 (half a reserve more)
    cut = 5 * MiB
    source = cgroup_v1(tmp_path, limit, 1 << 30, 0)
    models = [Llama(str(path), n_ctx=256, verbose=False, moe_slots=128, moe_elastic=False) for _ in range(2)]
    stop = threading.Event()

    def kernel():
        given = 0
        while not stop.is_set():
            now = sum(m.moe_stats()["budget"]["given_back_bytes"] for m in models)
            if now != given:
                stop.wait(0.012)
                Path(source["usage"]).write_text(f"{used - now}\n")
                given = now
            stop.wait(0.001)

    thread = threading.Thread(target=kernel)
    try:
        for llm in models:
            llm.eval(llm.tokenize(b"The quick brown fox"))
            decode(llm, [], 4)
            assert llm.moe_stats()["budget"]["resident_bytes"] > 2 * cut
            llm._experts.watch_memory([source], reserve, interval_ms=20)
        Path(source["usage"]).write_text(f"{used}\n")  # another program takes memory
        thread.start()
        assert wait_for(lambda: any(m.moe_stats()["budget"]["n_shrinks"] for m in models))
        time.sleep(1.0)
        budgets = [m.moe_stats()["budget"] for m in models]
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        for llm in models:
            llm.close()
    given = sum(b["given_back_bytes"] for b in budgets)
    assert sorted(b["n_shrinks"] for b in budgets) == [0, 1], budgets
    expert = max(layer.expert_bytes for layer in load_index(path).layers)
    assert cut <= given < cut + expert, (given, budgets)  # one cut, in whole experts
