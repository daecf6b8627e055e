"""The two read paths (moe_read_io, EMPANEL_READ_IO): the reader threads and io_uring land the
same bytes, so pooled runs on either equal stock llama.cpp in the layout they name, bit for bit;
reads that come back short are read to the end on both; io_uring refused falls back to the
threads with a notice; the plan carries the path to llama.cpp's programs.

The read-failure tests (EIO, a file that changes, moe_verify) run on both paths too, through the
read_io fixture (tests/conftest.py): test_slots_guard.py, test_verify.py.
"""

import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.lab.exactness import greedy_logits
from empanel_gguf.models import fixtures
from empanel_gguf.planning import plan_file
from empanel_gguf.planning.index import load_index
from empanel_gguf.engine.native import native
from empanel_gguf.planning.plan import moe_options, plan_load

TEXT = b" ".join(b"%d: the %s fox, seen %d times." % (i, b"quick" if i % 3 else b"slow", i * 7) for i in range(30))
KW = dict(n_ctx=1024, logits_all=True, verbose=False)
N_GREEDY = 8


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("read-io-fixtures")


_stock = {}


def run(path, moe_slots, **moe):
    """(logits of the prompt and N_GREEDY greedy tokens, the tokens, moe_stats())."""
    llm = Llama(str(path), moe_slots=moe_slots, **dict(KW, **moe))
    try:
        logits, tokens = greedy_logits(llm, llm.tokenize(TEXT), N_GREEDY)
        return logits, tokens, llm.moe_stats()
    finally:
        llm.close()


def stock(path, stats):
    """Stock llama.cpp, every expert resident, as the pooled run with these stats names it
    (moe_stats()["exact_kwargs"]: the layout and the plan's micro-batch)."""
    kwargs = stats["exact_kwargs"]
    key = (str(path), tuple(sorted(kwargs.items())))
    if key not in _stock:
        _stock[key] = run(path, None, **kwargs)
    return _stock[key]


@pytest.mark.parametrize("name", ["qwen3moe-q4_k", "qwen3moe-q4_0", "qwen3moe-f32"])
def test_both_paths_equal_stock(fixture_dir, read_io, name):
    """Paged pools (top-k and 25 % of the experts: O_DIRECT windows in place and through bounce
    buffers, overlapped reads) on this path: the logits and tokens of stock in the layout that
    moe_stats() names, and the path moe_stats() names is the one asked for."""
    path = fixtures.write_fixture(name, fixture_dir)
    for moe_slots in (fixtures.FIXTURES[name].n_expert_used, "25%"):
        logits, tokens, stats = run(path, moe_slots)
        assert stats["read_io"] == read_io
        assert stats["total"]["misses"] > 0
        ref_logits, ref_tokens, _ = stock(path, stats)
        assert tokens == ref_tokens, moe_slots
        assert np.array_equal(logits, ref_logits), moe_slots


@pytest.mark.parametrize("name", ["qwen3moe-q4_k", "qwen3moe-f32"])
def test_read_ahead_beside_the_layers_reads(fixture_dir, read_io, name):
    """moe_prefetch: the next layer's guessed experts are posted in the read-ahead lane while the
    layer computing now still has its own reads in flight in the demand lane, and read behind
    them (prefetch_beside counts such read-aheads); with 1 and 2 layers ahead, short reads, on
    this path: stock --no-repack's logits and tokens."""
    path = fixtures.write_fixture(name, fixture_dir)
    for prefetch in (1, 2):
        logits, tokens, stats = run(path, "25%", moe_prefetch=prefetch)
        ref_logits, ref_tokens, _ = stock(path, stats)
        t = stats["total"]
        assert stats["exact_to"].startswith("llama.cpp --no-repack") and stats["read_io"] == read_io
        assert t["prefetched"] > 0 and t["prefetch_beside"] > 0 and t["overlapped"] > 0, t
        assert tokens == ref_tokens and np.array_equal(logits, ref_logits), prefetch


@pytest.mark.parametrize("direct_io", [True, False])
def test_short_reads_are_read_to_the_end(fixture_dir, read_io, monkeypatch, direct_io):
    """EMPANEL_FAULT_SHORT_READS=1: every request first asks for half its bytes, as a read that
    comes back short returns them; the path reads the rest (pread again, or the ring queues the
    rest), so the outputs stay stock's, O_DIRECT windows and buffered reads alike."""
    path = fixtures.write_fixture("qwen3moe-q4_k", fixture_dir)
    monkeypatch.setenv("EMPANEL_FAULT_SHORT_READS", "1")
    logits, tokens, stats = run(path, "25%", moe_direct_io=direct_io)
    assert stats["read_io"] == read_io and stats["total"]["misses"] > 0
    ref_logits, ref_tokens, _ = stock(path, stats)
    assert tokens == ref_tokens
    assert np.array_equal(logits, ref_logits)


def test_refused_io_uring_falls_back_to_threads(fixture_dir, monkeypatch, capfd):
    """Where the kernel refuses io_uring (EMPANEL_FAULT_URING=1 stands for a container's seccomp
    profile), moe_read_io="uring" reads with the threads, says so once, and stays exact."""
    path = fixtures.write_fixture("qwen3moe-q4_k", fixture_dir)
    monkeypatch.setenv("EMPANEL_FAULT_URING", "1")
    capfd.readouterr()
    logits, tokens, stats = run(path, "25%", moe_read_io="uring", verbose=True)
    assert stats["read_io"] == "threads"
    assert "io_uring is not available (refused: EMPANEL_FAULT_URING): reading with threads" in capfd.readouterr().err
    ref_logits, ref_tokens, _ = stock(path, stats)
    assert tokens == ref_tokens and np.array_equal(logits, ref_logits)


@pytest.mark.parametrize("bad", [dict(moe_read_io="fast"), dict(moe_read_io=True), dict(moe_queue_depth=0),
                                 dict(moe_queue_depth=257), dict(moe_queue_depth=True)])
def test_bad_read_options_are_value_errors(fixture_dir, bad):
    path = fixtures.write_fixture("qwen3moe-q4_k", fixture_dir)
    with pytest.raises(ValueError, match="moe_read_io|moe_queue_depth"):
        Llama(str(path), moe_slots="25%", **KW, **bad)


def test_the_plan_carries_the_read_path(fixture_dir, monkeypatch):
    """The plan (what llama.cpp's programs load from, and the Python process too) names the path
    and depth in its `io` record; the sidecar reads it back, and refuses one out of bounds."""
    from conftest import require_uring

    require_uring()
    monkeypatch.delenv("EMPANEL_READ_IO", raising=False)
    path = fixtures.write_fixture("qwen3moe-q4_k", fixture_dir)
    index = load_index(path)
    load = plan_load(index, "25%", {}, options=moe_options(moe_read_io="uring", moe_queue_depth=16))
    text = plan_file.plan_text(index, load.pools)
    assert "\nio 2 16\n" in text
    for moe_read_io, want in (("uring", "uring"), ("threads", "threads"), ("auto", "uring")):
        _, _, stats = run(path, "25%", moe_read_io=moe_read_io, moe_queue_depth=16)
        assert stats["read_io"] == want, moe_read_io
    n = native()
    err = n.ffi.new("char[]", 512)
    for bad in ("io 3 16", "io 2 257", "io -1 0", "io 2"):
        handle = n.sidecar.empanel_load_open(text.replace("io 2 16", bad).encode(), n.ffi.NULL, str(path).encode(),
                                             err, 512)
        assert handle == n.ffi.NULL, bad
        assert "io" in n.ffi.string(err).decode(), bad


def _uring_load(path, monkeypatch):
    from conftest import require_uring

    require_uring()
    monkeypatch.setenv("EMPANEL_READ_IO", "uring")
    return Llama(str(path), moe_slots="25%", moe_preload=False, **KW)


def test_a_refused_submission_fails_once_then_preads(fixture_dir, monkeypatch):
    """The kernel refuses a submission (EMPANEL_FAULT_URING_SUBMIT=3: EPERM, as a seccomp profile
    answers io_uring_enter): that eval raises MoeReadError naming it and takes no token in; the
    ring is not used again, the same thread reads with pread, and the same prompt then gives
    stock's logits (no slot kept bytes it never got)."""
    from empanel_gguf import MoeReadError

    path = fixtures.write_fixture("qwen3moe-q4_k", fixture_dir)
    monkeypatch.setenv("EMPANEL_FAULT_URING_SUBMIT", "3")
    llm = _uring_load(path, monkeypatch)
    try:
        tokens = llm.tokenize(TEXT)
        with pytest.raises(MoeReadError, match=r"Operation not permitted \(io_uring\)"):
            llm.eval(tokens)
        assert llm.n_tokens == 0
        assert llm.moe_stats()["read_io"] == "threads"
        llm.reset()
        logits, got = greedy_logits(llm, tokens, N_GREEDY)
        stats = llm.moe_stats()
    finally:
        llm.close()
    ref_logits, ref_tokens, _ = stock(path, stats)
    assert got == ref_tokens and np.array_equal(logits, ref_logits)


def test_a_ring_that_stops_answering_fails_every_later_read(fixture_dir, monkeypatch):
    """The kernel stops answering with reads in flight (EMPANEL_FAULT_URING_WAIT=4: the wait
    fails with EFAULT): those reads may still land, so no read is safe in this process any more:
    the eval raises MoeReadError saying what to do, every later one too (none reuses a buffer
    the kernel may write), and close() frees the model without a crash."""
    from empanel_gguf import MoeReadError

    path = fixtures.write_fixture("qwen3moe-q4_k", fixture_dir)
    monkeypatch.setenv("EMPANEL_FAULT_URING_WAIT", "4")
    llm = _uring_load(path, monkeypatch)
    try:
        tokens = llm.tokenize(TEXT)
        with pytest.raises(MoeReadError, match="io_uring stopped answering.*EMPANEL_READ_IO=threads"):
            llm.eval(tokens)
        assert llm.n_tokens == 0
        llm.reset()
        with pytest.raises(MoeReadError, match="io_uring lost reads earlier"):
            llm.eval(tokens)
        assert llm.n_tokens == 0
    finally:
        llm.close()
    assert llm.moe_stats() is None
