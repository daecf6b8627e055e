"""The sidecar on its own: eviction policies, reads, and failures, driven through empanel_remap
with chosen expert ids on the real pools of a loaded model (F32 experts: slots hold the file's
bytes as they are, so a slot can be compared with the file)."""

import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.lab.exactness import greedy_logits
from empanel_gguf.planning.index import load_index

NAME = "qwen3moe-f32"  # 16 experts, top-4, experts in plain CPU memory


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return fixtures.write_fixture(NAME, tmp_path_factory.mktemp("pool"))


def open_llm(path, **kwargs):
    kwargs.setdefault("moe_slots", 4)
    return Llama(str(path), n_ctx=64, verbose=False, **kwargs)


class Driver:
    """Calls empanel_remap of a Llama's pool directly, one micro-batch at a time."""

    def __init__(self, llm):
        self.experts = llm._experts
        self.n = self.experts.n
        self.pool = self.experts.pool

    def remap(self, layer, rows):
        """rows: expert ids per token; returns slot ids per token, or None on failure."""
        ffi = self.n.ffi
        n_used = len(rows[0])
        ids = ffi.new("int32_t[]", [e for row in rows for e in row])
        slots = ffi.new("int32_t[]", len(rows) * n_used)
        rc = self.n.sidecar.empanel_remap(self.pool, layer, self.n.ffi.NULL, 0, 1, ids, n_used, slots, n_used, len(rows))
        if rc != 0:
            return None
        return [[slots[t * n_used + j] for j in range(n_used)] for t in range(len(rows))]

    def layer_stats(self, layer):
        return self.experts.stats()["layers"][layer]


def slot_contents(llm, index, layer, slot):
    """The bytes of every expert tensor of `layer` in `slot`, read from the pool memory."""
    n = llm._experts.n
    model = n.ptr(llm._model.model)
    out = {}
    for kind, t in index.layer(layer).tensors.items():
        info = n.ffi.new("struct llama_empanel_pool_info *")
        assert n.llama.llama_empanel_pool_info(model, t.name.encode(), info)
        assert info.n_slots == llm._experts.n_slots[layer] and info.slot_bytes == t.stride
        data = n.sidecar.empanel_backend_slot_data(info.tensor, slot)
        assert data != n.ffi.NULL, "F32 pools are plain host memory"
        out[kind] = bytes(n.ffi.buffer(data, t.stride))
    return out


def file_contents(index, layer, expert):
    out = {}
    for kind, t in index.layer(layer).tensors.items():
        path, offset, size = t.expert(expert)
        with open(path, "rb") as f:
            f.seek(offset)
            out[kind] = f.read(size)
    return out


def test_lru_evicts_least_recently_used(model_path):
    llm = open_llm(model_path, moe_slots=4, moe_policy="lru")
    try:
        d = Driver(llm)
        index = load_index(model_path)
        slot = {}
        for e in (0, 1, 2, 3):                       # fill 4 slots: 4 misses
            slot[e] = d.remap(0, [[e]])[0][0]
        assert sorted(slot.values()) == [0, 1, 2, 3]
        assert d.remap(0, [[0]])[0][0] == slot[0]    # hit: 0 is now most recent
        s4 = d.remap(0, [[4]])[0][0]                 # miss: evicts 1, the least recent
        assert s4 == slot[1]
        s1 = d.remap(0, [[1]])[0][0]                 # miss again: evicts 2
        assert s1 == slot[2]
        stats = d.layer_stats(0)
        assert (stats["hits"], stats["misses"], stats["n_resident"]) == (1, 6, 4)
        for e, s in ((0, slot[0]), (4, s4), (1, s1), (3, slot[3])):
            assert slot_contents(llm, index, 0, s) == file_contents(index, 0, e)
        assert d.layer_stats(1)["misses"] == 0       # layers are independent
    finally:
        llm.close()


def test_lfu_decay_keeps_the_frequent_expert(model_path):
    llm = open_llm(model_path, moe_slots=4, moe_policy="lfu-decay")
    try:
        d = Driver(llm)
        for e in (0, 0, 0, 1, 2, 3):
            d.remap(0, [[e]])
        s0 = d.remap(0, [[0]])[0][0]
        s5 = d.remap(0, [[5]])[0][0]                 # LRU would evict 1 as well; 0 must stay
        assert s5 != s0
        s6 = d.remap(0, [[6]])[0][0]
        assert s6 != s0 and d.remap(0, [[0]])[0][0] == s0
    finally:
        llm.close()


@pytest.mark.parametrize("chunk_kb,direct_io,threads", [(4, True, 8), (8, True, 1), (256, True, 0),
                                                        (4, False, 3), (256, False, 8)])
def test_reads_land_exactly_whatever_the_chunking(model_path, chunk_kb, direct_io, threads):
    llm = open_llm(model_path, moe_slots=16, moe_chunk_kb=chunk_kb, moe_direct_io=direct_io,
                   moe_io_threads=threads, moe_preload=False)  # 16 = every expert: read on demand
    try:
        d = Driver(llm)
        index = load_index(model_path)
        rows = [[e, e + 4, e + 8, e + 12] for e in range(4)]  # 16 distinct experts
        slots = d.remap(1, rows)
        for row, srow in zip(rows, slots):
            for e, s in zip(row, srow):
                assert slot_contents(llm, index, 1, s) == file_contents(index, 1, e)
        stats = d.layer_stats(1)
        assert stats["misses"] == 16 and stats["bytes_read"] == 16 * index.layer(1).expert_bytes
        if direct_io:
            assert stats["io_bytes"] >= stats["bytes_read"]   # aligned windows
        else:
            assert stats["io_bytes"] == stats["bytes_read"]
        assert stats["n_reads"] >= 16 * len(index.layer(1).tensors)
    finally:
        llm.close()


def test_micro_batch_beyond_the_pool_fails_cleanly(model_path):
    llm = open_llm(model_path, moe_slots=4)
    try:
        d = Driver(llm)
        assert d.remap(0, [[0, 1, 2, 3], [4, 5, 6, 7]]) is None   # 8 distinct experts, 4 slots
        assert llm._experts.failed()
        assert "more distinct experts than the 4 slots" in llm._experts.error()
        assert d.remap(0, [[0, 1, 2, 3]]) is None                  # stays failed until cleared
        llm._experts.clear_error()
        assert d.remap(0, [[0, 1, 2, 3]]) is not None
        assert d.remap(0, [[16, 0, 1, 2]]) is None                 # no such expert
        assert "expert 16 of 16" in llm._experts.error()
        llm._experts.clear_error()
        # the model still decodes after the failures were cleared
        llm.eval(llm.tokenize(b"still fine"))
    finally:
        llm.close()


def test_bad_options_are_refused(model_path):
    with pytest.raises(ValueError, match="moe_policy"):
        open_llm(model_path, moe_policy="fifo")
    with pytest.raises(ValueError, match="moe_chunk_kb"):
        open_llm(model_path, moe_chunk_kb=1)


def test_glru_shares_one_budget_across_layers(model_path):
    """moe_slots=4 with g-lru: a budget of 4 experts x 3 layers, up to 8 in one layer."""
    llm = open_llm(model_path, moe_slots=4, moe_policy="g-lru")
    try:
        d = Driver(llm)
        index = load_index(model_path)
        expert = index.layer(0).expert_bytes
        sidecar = llm._experts.n.sidecar
        assert d.layer_stats(0)["n_slots"] == 8
        d.remap(0, [[0, 1, 2, 3]])
        d.remap(0, [[4, 5, 6, 7]])                  # layer 0 above its even share: 8 resident
        d.remap(1, [[0, 1, 2, 3]])                  # 12 experts: the whole budget
        assert sidecar.empanel_pool_resident_bytes(d.pool) == 12 * expert
        d.remap(1, [[8, 9, 10, 11]])                # room from the least recent: layer 0's 0..3
        assert (d.layer_stats(0)["n_resident"], d.layer_stats(1)["n_resident"]) == (4, 8)
        assert sidecar.empanel_pool_resident_bytes(d.pool) == 12 * expert
        assert d.remap(0, [[4, 5, 6, 7]]) and d.layer_stats(0)["hits"] == 4  # still there
        d.remap(0, [[0, 1, 2, 3]])                  # back: layer 1's 0..3 go now
        assert (d.layer_stats(0)["n_resident"], d.layer_stats(1)["n_resident"]) == (8, 4)
        for e, s in zip((0, 1, 2, 3), d.remap(0, [[0, 1, 2, 3]])[0]):
            assert slot_contents(llm, index, 0, s) == file_contents(index, 0, e)
    finally:
        llm.close()


@pytest.mark.parametrize("name", ["qwen3moe-q4_0", "deepseek2", "qwen3moe-mixed"])
def test_glru_bit_identical(tmp_path_factory, name):
    path = fixtures.write_fixture(name, tmp_path_factory.mktemp("glru"))
    spec = fixtures.FIXTURES[name]
    logits = {}
    for policy, slots in (("g-lru", spec.n_expert_used), (None, None)):
        n_ubatch = 1
        llm = Llama(str(path), n_ctx=128, n_ubatch=n_ubatch, logits_all=True, verbose=False,
                    moe_slots=slots, **({"moe_policy": policy} if policy else {}))
        try:
            logits[policy] = greedy_logits(llm, b"global budget, same numbers", 16)[0]
        finally:
            llm.close()
    assert np.array_equal(logits["g-lru"], logits[None])


RSS_SCRIPT = """
import sys
from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.lab.exactness import greedy_logits
path = fixtures.write_fixture("qwen3moe-rss", sys.argv[1])
llm = Llama(str(path), n_ctx=128, verbose=False, moe_slots=int(sys.argv[2]), moe_policy=sys.argv[3])
for t in range(60):
    llm.eval([(7 * t + 3) % 250 + 1])
rss = [l for l in open("/proc/self/status") if l.startswith("RssAnon")][0].split()[1]
print("RSSANON", int(rss) * 1024, llm._experts.n.sidecar.empanel_pool_resident_bytes(llm._experts.pool))
"""


def test_glru_pools_take_only_the_budget(tmp_path):
    """Host pools hold memory only where an expert is: g-lru with a budget of 64 experts per
    layer (pools of 128) takes about the memory of per-layer LRU pools of 64, not 128."""
    import os
    import subprocess
    import sys

    index = load_index(fixtures.write_fixture("qwen3moe-rss", tmp_path))
    expert = index.layers[0].expert_bytes
    out = {}
    for slots, policy in ((64, "g-lru"), (128, "lru")):
        proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path), str(slots), policy],
                              capture_output=True, text=True, timeout=300,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        line = [text for text in proc.stdout.splitlines() if text.startswith("RSSANON")]
        assert line, proc.stderr[-2000:]
        out[policy] = [int(x) for x in line[0].split()[1:]]
    rss_glru, resident_glru = out["g-lru"]
    rss_lru, resident_lru = out["lru"]
    assert resident_glru <= 64 * 2 * expert < resident_lru
    # the 64 x 2 experts g-lru does not hold are memory it does not take (pages of partly used
    # slots aside)
    assert rss_lru - rss_glru >= 0.7 * (resident_lru - resident_glru), (rss_lru, rss_glru)
