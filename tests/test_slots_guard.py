"""Guards around the slot pools: nothing of the experts is read at load, the memory they save is
really saved, bad inputs and files that change under a loaded model fail clearly, and one model
serves several contexts and prompts one after another.

Every test loads real fixture files with the real llama.cpp build; nothing is mocked. Exactness
comparisons run the baseline with the slot run's n_ubatch (llama.cpp's kernels differ by
micro-batch size, so only equal micro-batches are comparable bit for bit); nothing caps it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from empanel_gguf.lab.exactness import greedy_logits
from empanel_gguf import Llama, MoeReadError
from empanel_gguf.models import fixtures
from empanel_gguf.engine.native import native
from empanel_gguf.planning.index import ModelError, load_index
from empanel_gguf.planning.sizing import SlotsError, plan_slots

REPO = Path(__file__).resolve().parents[1]
PROMPT = b"Hello the world, and this is a test"
MORE = b" of the slots when the file is gone and the model still runs on"
PROMPTS = (b"The quick brown fox jumps over the lazy dog",
           b"Once upon a time in a land far away",
           b"1, 2, 3, 4, 5, 6, 7, 8")
KW = dict(n_ctx=256, n_batch=64, n_threads=2, logits_all=True, seed=0, verbose=False)


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("guard-fixtures")


def model(fixture_dir, name):
    return fixtures.write_fixture(name, fixture_dir)


evaluate = greedy_logits


def fresh(path, prompt, moe_slots, n_ubatch, n_greedy=0, **moe):
    """A fresh load: (logits, tokens, n_ubatch used)."""
    llm = Llama(str(path), moe_slots=moe_slots, n_ubatch=n_ubatch, **KW, **moe)
    try:
        logits, tokens = evaluate(llm, prompt, n_greedy)
        return logits, tokens, llm.context_params.n_ubatch
    finally:
        llm.close()


def n_pools(llm):
    """Slot pools llama.cpp made for this model (0: loaded as stock llama.cpp)."""
    n = native()
    return n.llama.llama_empanel_n_pools(n.ptr(llm._model.model))


@contextlib.contextmanager
def unraisable():
    """Collect exceptions raised where Python can only report them (__del__ of a failed Llama)."""
    seen = []
    saved = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        yield seen
    finally:
        sys.unraisablehook = saved


def raises_cleanly(exc, path, moe_slots, **kwargs):
    """Llama(path, moe_slots) raises exc; the half-made object then goes away without an error of
    its own (a traceback printed at garbage collection is not a clear error). Returns the message."""
    with unraisable() as seen:
        with pytest.raises(exc) as err:
            Llama(str(path), moe_slots=moe_slots, **dict(KW, **kwargs))
        message = str(err.value)
        err = None  # drop the traceback and with it the half-made Llama
        gc.collect()
    assert not seen, [f"{type(u.exc_value).__name__}: {u.exc_value}" for u in seen]
    return message


def rchar():
    """Bytes this process has passed through read syscalls so far (all threads, any file)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar")


# ------------------------------------------------------------------------------------------------
# 1. nothing of the routed experts is read at load


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_experts_are_not_read_at_load(fixture_dir, monkeypatch):
    # rchar counts the bytes of read syscalls, which io_uring's reads are not: the threads path,
    # so that the counter sees the sidecar's reads (checked below)
    monkeypatch.setenv("EMPANEL_READ_IO", "threads")
    path = model(fixture_dir, "qwen3moe-256x")
    index = load_index(path)
    file_size = path.stat().st_size
    # experts dominate this file: 256 per layer, ~93 % of the bytes
    assert index.expert_bytes_total > 10 * (file_size - index.expert_bytes_total)

    # warm-up on another model: imports, the native seam, llama.cpp's backend and CPU probing
    warm = Llama(str(model(fixture_dir, "qwen3moe-f32")), moe_slots=4, **KW)
    evaluate(warm, PROMPT)
    warm.close()

    before = rchar()
    llm = Llama(str(path), moe_slots=index.n_expert_used, **KW)
    during_load = rchar() - before
    try:
        assert llm.moe_stats()["total"]["bytes_read"] == 0
        assert llm.moe_stats()["total"]["misses"] == 0
        # Everything but the experts is read once (header + resident weights = file - experts).
        # Allowed on top: the header a second time (our index and llama.cpp's gguf reader each
        # parse it) and 64 KiB for buffered readers rounding up to their block size and small
        # reads of /proc and /sys. Far less than one layer's experts (> 1 MiB here).
        header = index.shards[0].data_offset
        bound = (file_size - index.expert_bytes_total) + header + 64 * 1024
        print(f"\nrchar during load: {during_load} bytes; bound {bound}; "
              f"experts {index.expert_bytes_total}, file {file_size}")
        assert during_load < bound
        assert bound < index.expert_bytes_total / index.n_layer / 2

        before = rchar()
        evaluate(llm, PROMPT)
        during_decode = rchar() - before
        total = llm.moe_stats()["total"]
        assert total["bytes_read"] > 0 and total["misses"] > 0
        # the same counter does see the sidecar's reads: the check above is not blind to them
        assert during_decode >= total["bytes_read"]
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------------
# 2. memory

_RSS_SCRIPT = """
import json, sys
from empanel_gguf import Llama
path, moe_slots, use_mmap, n_ubatch = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
llm = Llama(path, moe_slots=moe_slots, use_mmap=use_mmap, n_ctx=64, n_batch=64, n_ubatch=n_ubatch,
            n_threads=2, verbose=False)
llm.eval(llm.tokenize(b"Hello the world, and this is a test"))
assert llm.context_params.n_ubatch == n_ubatch
status = {}
with open("/proc/self/status") as f:
    for line in f:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            status[key] = int(value.split()[0]) * 1024
print(json.dumps(status))
"""


def _child_json(script, *args):
    """Run `script` in a fresh interpreter on this checkout; the JSON of its last output line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rss(path, moe_slots, use_mmap, n_ubatch):
    return _child_json(_RSS_SCRIPT, path, json.dumps(moe_slots), "1" if use_mmap else "0", n_ubatch)


_LOAD_PEAK_SCRIPT = """
import json, sys
from empanel_gguf import Llama
llm = Llama(sys.argv[1], moe_slots=int(sys.argv[2]), moe_policy=sys.argv[3], moe_preload=False, n_ctx=64,
            n_batch=64, n_threads=2, verbose=False)
status = {}
with open("/proc/self/status") as f:
    for line in f:
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            status[key] = int(value.split()[0]) * 1024
print(json.dumps(status))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.parametrize("policy", ["lru", "g-lru"])
def test_empty_pools_take_no_memory_even_while_loading(fixture_dir, policy):
    """Pools are never written at load, in any buffer type (CPU_REPACK included): the peak RSS of
    a load with half the experts in slots is that of a load with the minimum."""
    # Q4_K experts: CPU_REPACK pools on x86 with AVX2 and on ARM (the layout stock picks)
    spec = dataclasses.replace(fixtures.FIXTURES["qwen3moe-rss"], name="qwen3moe-rss-q4_k", n_ff_exp=256,
                               expert_types=(), requantize_to="Q4_K")
    path = fixture_dir / "qwen3moe-rss-q4_k.gguf"
    if not path.exists():
        fixtures.write_model(spec, path)
    index = load_index(path)

    def peak(n_slots):
        return _child_json(_LOAD_PEAK_SCRIPT, path, n_slots, policy)["VmHWM"]

    half = plan_slots(index, index.n_expert // 2, policy)
    small = plan_slots(index, index.n_expert_used, policy)
    pools_apart = half.capacity_bytes - small.capacity_bytes  # what touching the pools would add
    assert pools_apart > 20 * 2**20
    grown = peak(index.n_expert // 2) - peak(index.n_expert_used)
    print(f"\npeak RSS at load: +{grown / 2**20:.1f} MiB for {pools_apart / 2**20:.1f} MiB more of pools")
    assert grown < pools_apart / 4


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_rss_drops_by_the_experts_not_held(fixture_dir):
    path = model(fixture_dir, "qwen3moe-rss")
    index = load_index(path)
    n_slots = 8  # the minimum: top-8
    plan = plan_slots(index, n_slots)
    not_held = index.expert_bytes_total - plan.pool_bytes
    assert not_held > 45 * 2**20  # large enough to see over interpreter and allocator noise
    n_ubatch = 64  # every run the same (same compute buffers); the slot run's prompt runs in waves

    slots = _rss(path, n_slots, True, n_ubatch)  # slots always load without mmap
    # Stock llama.cpp maps the file with MAP_POPULATE by default: the mapped file's pages count in
    # its RSS (RssFile), but they are clean page cache that the kernel may drop. The like-for-like
    # comparison is stock with use_mmap=False: every weight in anonymous memory exactly once, as
    # the slot run holds its resident weights. That is the one asserted; the mapped one is printed.
    stock = _rss(path, None, False, n_ubatch)
    stock_mmap = _rss(path, None, True, n_ubatch)
    saved = stock["VmRSS"] - slots["VmRSS"]
    mib = 2**20
    print(f"\nRSS stock (use_mmap=False) {stock['VmRSS'] / mib:.1f} MiB "
          f"(anon {stock['RssAnon'] / mib:.1f}), stock (mmap) {stock_mmap['VmRSS'] / mib:.1f} MiB "
          f"(file {stock_mmap['RssFile'] / mib:.1f}), slots={n_slots} {slots['VmRSS'] / mib:.1f} MiB "
          f"(anon {slots['RssAnon'] / mib:.1f}); saved {saved / mib:.1f} MiB of "
          f"{not_held / mib:.1f} MiB of experts not held")
    # The slot run's own overhead: the sidecar's cffi binding (pycparser parses its header), its
    # tables and read buffers, the remap ops in the graph; about 3 MiB measured, 12 MiB allowed.
    overhead = 12 * mib
    assert saved >= not_held - overhead
    # and it is the experts that went: anonymous memory fell by as much
    assert stock["RssAnon"] - slots["RssAnon"] >= not_held - overhead


# ------------------------------------------------------------------------------------------------
# 3. bad inputs


def test_too_few_slots_names_the_numbers(fixture_dir):
    path = model(fixture_dir, "qwen3moe-f32")  # 16 experts, top-4
    assert issubclass(SlotsError, ValueError)
    message = raises_cleanly(SlotsError, path, 3)
    assert "moe_slots=3" in message and "3 slots" in message
    assert "routes to 4 experts" in message and "at least 4" in message
    assert "16 experts" in message


@pytest.mark.parametrize("bad", ["0%", "abc", True, -3, 0, "1KiB", 2.5, "150%"],
                         ids=["0pct", "abc", "True", "minus3", "zero", "1KiB", "float", "150pct"])
def test_bad_moe_slots_are_value_errors(fixture_dir, bad):
    path = model(fixture_dir, "qwen3moe-f32")
    assert f"moe_slots={bad!r}" in raises_cleanly(ValueError, path, bad)


def test_nothing_lost_after_bad_inputs(fixture_dir):
    """After the errors above nothing is left behind: a stock load is stock, a slot load works."""
    path = model(fixture_dir, "qwen3moe-f32")
    for bad in (3, "abc", True):
        with pytest.raises(ValueError):
            Llama(str(path), moe_slots=bad, **KW)
    llm = Llama(str(path), moe_slots=None, **KW)
    try:
        assert n_pools(llm) == 0 and llm.moe_stats() is None  # no slot plan left over
        ref, _ = evaluate(llm, PROMPT)
    finally:
        llm.close()
    got, _, n_ubatch = fresh(path, PROMPT, 4, 512)
    assert n_ubatch == KW["n_batch"]
    assert np.array_equal(got, ref)


def test_more_slots_than_experts_clamps_with_a_notice(fixture_dir, capfd):
    path = model(fixture_dir, "qwen3moe-f32")
    llm = Llama(str(path), moe_slots=100, **dict(KW, verbose=True))
    try:
        err = capfd.readouterr().err
        assert "moe_slots=100: 100 slots clamped to the 16 experts per layer" in err
        stats = llm.moe_stats()
        assert all(row["n_slots"] == 16 for row in stats["layers"].values())
        n_ubatch = llm.context_params.n_ubatch
        assert n_ubatch == min(KW["n_ctx"], KW.get("n_batch", 512))  # pools hold every expert: no cap
        got, _ = evaluate(llm, PROMPT, n_greedy=4)
    finally:
        llm.close()
    ref, _, _ = fresh(path, PROMPT, None, n_ubatch, n_greedy=4)
    assert np.array_equal(got, ref)


def test_dense_model_loads_stock_with_a_notice(fixture_dir, capfd):
    path = model(fixture_dir, "llama-dense")
    assert not load_index(path).is_moe
    llm = Llama(str(path), moe_slots=4, **dict(KW, verbose=True))
    try:
        err = capfd.readouterr().err
        assert "no routed experts (llama); moe_slots ignored" in err
        assert llm.moe_stats() is None and n_pools(llm) == 0
        assert llm.context_params.n_ubatch == llm.n_batch  # not capped: no pools to fit
        got, tokens = evaluate(llm, PROMPT, n_greedy=8)
    finally:
        llm.close()
    assert np.isfinite(got).all() and np.ptp(got[-1]) > 0
    ref, ref_tokens, _ = fresh(path, PROMPT, None, llm.n_batch, n_greedy=8)
    assert tokens == ref_tokens and np.array_equal(got, ref)


def test_truncated_file_fails_before_llama_cpp(fixture_dir, tmp_path, capfd):
    src = model(fixture_dir, "qwen3moe-f32")
    index = load_index(src)
    path = tmp_path / "cut.gguf"
    shutil.copy(src, path)
    cut = index.layers[-1].tensors["down"].offset + 100  # inside the last layer's experts
    os.truncate(path, cut)
    capfd.readouterr()
    assert issubclass(ModelError, ValueError)
    message = raises_cleanly(ModelError, path, 4, verbose=True)
    assert str(path) in message and "truncated" in message
    assert "blk.2.ffn_down_exps.weight" in message
    # llama.cpp logs every model it opens (verbose=True): it was never reached
    assert "llama_model_load" not in capfd.readouterr().err
    # control: the same file without moe_slots reaches llama.cpp, which logs and refuses it
    with pytest.raises(ValueError):
        Llama(str(path), moe_slots=None, **dict(KW, verbose=True))
    assert "llama_model_load" in capfd.readouterr().err


# ------------------------------------------------------------------------------------------------
# 3b. the model file changes while loaded


def _check_healthy_load_still_works(src, ref):
    got, _, _ = fresh(src, PROMPT, 4, 512)
    assert np.array_equal(got, ref)


@pytest.fixture(scope="module")
def f32_reference(fixture_dir):
    """qwen3moe-f32 at the minimum (4 slots; the prompt runs in waves): the logits of PROMPT, and of
    PROMPT+MORE fed token by token after it, from stock llama.cpp with its defaults."""
    src = model(fixture_dir, "qwen3moe-f32")
    llm = Llama(str(src), moe_slots=None, **KW)
    try:
        prompt, _ = evaluate(llm, PROMPT)
        for token in llm.tokenize(MORE, add_bos=False):
            llm.eval([token])
        full = np.array(llm.scores[: llm.n_tokens], copy=True)
    finally:
        llm.close()
    return src, prompt, full


def _load_copy_and_eval(src, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy(src, path)
    llm = Llama(str(path), moe_slots=4, **KW)
    assert llm.context_params.n_ubatch == KW["n_batch"]  # no cap: waves
    logits, _ = evaluate(llm, PROMPT)
    return path, llm, logits


def _next_decode_raises(llm):
    """The next decode raises MoeReadError, hit or miss, and takes nothing in; so does the one
    after (a changed file stays changed). Returns the message."""
    tokens = llm.tokenize(MORE, add_bos=False)
    messages = []
    for token in tokens[:2]:
        n_tokens = llm.n_tokens
        with pytest.raises(MoeReadError) as err:
            llm.eval([token])
        assert llm.n_tokens == n_tokens  # the failed token was not taken in
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    return messages[0]


# how the loaded file is watched: inotify (Linux), or the size/mtime/ctime checks used elsewhere
FILE_CHECKS = ["inotify", "stat"]


@pytest.fixture(params=FILE_CHECKS)
def file_check(request, monkeypatch):
    if request.param == "stat":
        monkeypatch.setenv("EMPANEL_FILE_WATCH", "0")
    elif not sys.platform.startswith("linux"):
        pytest.skip("inotify is Linux's")
    return request.param


@pytest.mark.usefixtures("read_io")  # on both read paths
def test_truncated_while_loaded_raises_and_survives(f32_reference, tmp_path, file_check):
    src, ref, _ = f32_reference
    path, llm, logits = _load_copy_and_eval(src, tmp_path)
    try:
        assert llm.moe_file_check == file_check
        assert np.array_equal(logits, ref)
        os.truncate(path, path.stat().st_size // 2)
        message = _next_decode_raises(llm)
        assert str(path) in message and "changed" in message
        llm.close()  # frees model, context and pools after a failed read
        assert llm.moe_stats() is None
    finally:
        llm.close()  # a second close is harmless
    _check_healthy_load_still_works(src, ref)


def _overwrite_experts(path, mtime_ns):
    """Same size, other bytes in the expert region; then the old mtime put back, as a copy tool
    or a re-download into place does."""
    size = path.stat().st_size
    t = load_index(path).layers[0].tensors["down"]
    with open(path, "r+b") as f:
        f.seek(t.offset)
        f.write(os.urandom(t.stride * 4))
    os.utime(path, ns=(path.stat().st_atime_ns, mtime_ns))
    assert path.stat().st_size == size and path.stat().st_mtime_ns == mtime_ns


@pytest.mark.usefixtures("read_io")  # on both read paths
def test_modified_in_place_with_mtime_restored_raises(f32_reference, tmp_path, file_check):
    src, ref, _ = f32_reference
    path, llm, logits = _load_copy_and_eval(src, tmp_path)
    try:
        assert np.array_equal(logits, ref)
        _overwrite_experts(path, path.stat().st_mtime_ns)
        message = _next_decode_raises(llm)
        assert str(path) in message and "changed" in message
        assert ("written to" in message) == (file_check == "inotify")
    finally:
        llm.close()
    _check_healthy_load_still_works(src, ref)


def test_pinned_pools_keep_the_loaded_weights_when_the_file_changes(f32_reference, tmp_path, file_check):
    """Pools that hold every expert are filled at load and never read again (stock's graph, no
    remap, no file check): like a stock load without mmap, a later write to the file is not seen,
    and the outputs stay those of the file as it was loaded."""
    src, _, ref_full = f32_reference
    path = tmp_path / "model.gguf"
    shutil.copy(src, path)
    llm = Llama(str(path), moe_slots="100%", **KW)
    try:
        assert llm.moe_load.pinned and llm.moe_file_check == file_check
        evaluate(llm, PROMPT)
        _overwrite_experts(path, path.stat().st_mtime_ns)
        for token in llm.tokenize(MORE, add_bos=False):
            llm.eval([token])
        assert np.array_equal(np.array(llm.scores[: llm.n_tokens]), ref_full)
        assert llm.moe_stats()["total"]["misses"] == 0
    finally:
        llm.close()


def test_write_outside_the_experts_raises_too(f32_reference, tmp_path):
    """A write to the dense part (mapped by llama.cpp, never read by us) fails the next decode."""
    src, ref, _ = f32_reference
    path, llm, logits = _load_copy_and_eval(src, tmp_path)
    try:
        t = load_index(path).layers[0].tensors["down"]
        with open(path, "r+b") as f:  # the same byte again: no content change, still a write
            f.seek(t.offset - 1)
            byte = f.read(1)
            f.seek(t.offset - 1)
            f.write(byte)
        _next_decode_raises(llm)
    finally:
        llm.close()


def test_replaced_by_rename_keeps_the_loaded_model(f32_reference, tmp_path):
    """os.replace over the path: our descriptors hold the old file, outputs stay the original's."""
    src, ref, ref_full = f32_reference
    path, llm, logits = _load_copy_and_eval(src, tmp_path)
    try:
        assert np.array_equal(logits, ref)
        # same layout and size, other weights: reading the new file would change the logits
        spec = dataclasses.replace(fixtures.FIXTURES["qwen3moe-f32"], seed=1234)
        other = fixtures.write_model(spec, tmp_path / "other" / "model.gguf")
        assert other.stat().st_size == path.stat().st_size
        staged = tmp_path / "model.gguf.new"
        shutil.copy(other, staged)
        os.replace(staged, path)
        misses = llm.moe_stats()["total"]["misses"]
        for token in llm.tokenize(MORE, add_bos=False):
            llm.eval([token])
        assert llm.moe_stats()["total"]["misses"] > misses  # experts were read after the swap
        got = np.array(llm.scores[: llm.n_tokens], copy=True)
    finally:
        llm.close()
    assert np.array_equal(got, ref_full)
    # a fresh load of the original (the untouched fixture) agrees too
    fresh_llm = Llama(str(src), moe_slots=4, **KW)
    try:
        evaluate(fresh_llm, PROMPT)
        for token in fresh_llm.tokenize(MORE, add_bos=False):
            fresh_llm.eval([token])
        assert np.array_equal(np.array(fresh_llm.scores[: fresh_llm.n_tokens]), got)
    finally:
        fresh_llm.close()
    # and the new file at the path is what a new load sees: different logits
    new_logits, _, _ = fresh(path, PROMPT, 4, 512)
    assert not np.array_equal(new_logits, ref)


# ------------------------------------------------------------------------------------------------
# 4. several contexts one after another


def test_two_models_one_after_another_agree(fixture_dir):
    path = model(fixture_dir, "qwen2moe")  # shared expert, 8 experts top-2
    first = fresh(path, PROMPTS[0], 2, 512, n_greedy=8)
    second = fresh(path, PROMPTS[0], 2, 512, n_greedy=8)
    assert first[1] == second[1]
    assert np.array_equal(first[0], second[0])
    ref = fresh(path, PROMPTS[0], None, first[2], n_greedy=8)
    assert first[1] == ref[1] and np.array_equal(first[0], ref[0])


def test_three_prompts_with_reset_match_fresh_loads(fixture_dir):
    path = model(fixture_dir, "deepseek2")  # dense lead layer, groups, shared expert; 16 experts top-4
    llm = Llama(str(path), moe_slots=4, **KW)
    try:
        n_ubatch = llm.context_params.n_ubatch
        assert n_ubatch == KW["n_batch"]  # no cap: prompts run in waves
        for i, prompt in enumerate(PROMPTS):
            llm.reset()
            got, _ = evaluate(llm, prompt)
            ref, _, _ = fresh(path, prompt, None, n_ubatch, moe_repack=False)  # the layout paged pools choose
            assert got.shape == ref.shape and np.array_equal(got, ref), f"prompt {i}"
        stats = llm.moe_stats()["total"]
        assert stats["hits"] > 0 and stats["misses"] > 0
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------------
# 5. preload: pools that hold every expert are filled at load, like a stock load


@pytest.mark.parametrize("name", ["qwen3moe-q4_k", "gpt-oss"])
def test_pools_of_every_expert_are_preloaded(fixture_dir, name):
    path = model(fixture_dir, name)
    index = load_index(path)
    llm = Llama(str(path), moe_slots=index.n_expert, **KW)
    try:
        total = llm.moe_stats()["total"]
        assert total["preloaded"] == index.n_expert * len(index.layers)
        assert total["n_resident"] == total["n_slots"] == index.n_expert * len(index.layers)
        assert total["bytes_read"] == index.expert_bytes_total  # each expert once
        assert total["misses"] == 0
        got, tokens = evaluate(llm, PROMPT, n_greedy=8)
        assert llm.moe_stats()["total"]["misses"] == 0  # decoding reads nothing more
        n_ubatch = llm.context_params.n_ubatch
    finally:
        llm.close()
    ref, ref_tokens, _ = fresh(path, PROMPT, None, n_ubatch, n_greedy=8)
    assert tokens == ref_tokens and np.array_equal(got, ref)


def test_preload_off_reads_on_first_use(fixture_dir):
    path = model(fixture_dir, "qwen3moe-q4_k")
    index = load_index(path)
    llm = Llama(str(path), moe_slots=index.n_expert, moe_preload=False, **KW)
    try:
        assert llm.moe_stats()["total"]["bytes_read"] == 0
        evaluate(llm, PROMPT)
        total = llm.moe_stats()["total"]
        assert total["preloaded"] == 0 and total["misses"] > 0
    finally:
        llm.close()


@pytest.mark.parametrize("policy", ["lru", "g-lru"])
def test_preload_of_smaller_pools_stays_exact_and_in_budget(fixture_dir, policy):
    path = model(fixture_dir, "qwen3moe-q8_0")
    index = load_index(path)
    k = index.n_expert_used
    plan = plan_slots(index, 2 * k, policy)
    llm = Llama(str(path), moe_slots=2 * k, moe_policy=policy, moe_preload=True, **KW)
    try:
        total = llm.moe_stats()["total"]
        if policy == "g-lru":  # the shared budget, not every slot, in even shares per layer
            assert total["bytes_read"] <= plan.budget_bytes
            assert total["preloaded"] == 2 * k * len(index.layers)
            assert all(row["n_resident"] == 2 * k for row in llm.moe_stats()["layers"].values())
        else:
            assert total["preloaded"] == total["n_resident"] == 2 * k * len(index.layers)
        got, tokens = evaluate(llm, PROMPT, n_greedy=8)
        assert llm.moe_stats()["total"]["hits"] > 0
        n_ubatch = llm.context_params.n_ubatch
    finally:
        llm.close()
    ref, ref_tokens, _ = fresh(path, PROMPT, None, n_ubatch, n_greedy=8)
    assert tokens == ref_tokens and np.array_equal(got, ref)


# ------------------------------------------------------------------------------------------------
# 5. a read that fails inside a prompt that runs in waves


_WAVE_FAULT_SCRIPT = """
import json, sys
import numpy as np
from empanel_gguf import Llama, MoeReadError
path, n_prompt = sys.argv[1], int(sys.argv[2])
llm = Llama(path, moe_slots=4, n_ctx=1024, logits_all=True, verbose=False)
tokens = llm.tokenize(b"the quick brown fox jumps over the lazy dog " * 40)[:n_prompt]
out = {"n_ubatch": llm.context_params.n_ubatch}
try:
    llm.eval(tokens)
    out["raised"] = None
except MoeReadError as e:
    out["raised"] = str(e)
out["n_tokens"] = llm.n_tokens
stats = llm.moe_stats()["total"]
out["n_waves"], out["n_remaps"], out["n_reads"] = stats["n_waves"], stats["n_remaps"], stats["n_reads"]
llm.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("share", [0.0, 0.5, 0.95])
@pytest.mark.usefixtures("read_io")  # on both read paths
def test_read_failure_inside_waves_raises_and_rolls_back(fixture_dir, share):
    """EMPANEL_FAULT_READ_AFTER makes the reader's N-th request fail with EIO (the first wave's
    demand read, or one read ahead while an earlier wave computes, later in the prompt): the
    prompt's eval raises MoeReadError, no token of it is taken in, the process is fine."""
    path = model(fixture_dir, "qwen3moe-f32")
    ok = _child_json(_WAVE_FAULT_SCRIPT, path, 300)
    assert ok["raised"] is None and ok["n_tokens"] == 300 and ok["n_waves"] > ok["n_remaps"]
    after = max(1, int(share * ok["n_reads"]))
    env_script = "import os; os.environ['EMPANEL_FAULT_READ_AFTER'] = %r\n" % str(after)
    failed = _child_json(env_script + _WAVE_FAULT_SCRIPT, path, 300)
    assert failed["raised"] is not None and "EMPANEL_FAULT_READ_AFTER" in failed["raised"]
    assert failed["n_tokens"] == 0  # the micro-batch's tokens were rolled back


@pytest.mark.parametrize("name, repack", [("qwen3moe-q4_k", False), ("qwen3moe-q4_k", True), ("qwen3moe-f32", True)])
@pytest.mark.usefixtures("read_io")  # on both read paths
def test_failed_read_into_slots_leaves_them_empty(fixture_dir, monkeypatch, name, repack):
    """Reads that land in place (a plain pool's slots, repacking's staging) and fail: the eval
    raises MoeReadError and takes in no token, and no slot is left marked as holding an expert
    it lacks: once the failing requests are spent, the same prompt gives the clean run's logits
    (a slot that claimed bytes it never got would change them)."""
    path = model(fixture_dir, name)
    text = b" ".join(b"%d landed in place" % i for i in range(40))

    def run(llm):
        llm.reset()
        llm.eval(llm.tokenize(text))
        return np.array(llm.scores[: llm.n_tokens])

    llm = Llama(str(path), moe_slots="25%", moe_repack=repack, n_ctx=1024, logits_all=True, verbose=False)
    try:
        clean = run(llm)
    finally:
        llm.close()
    monkeypatch.setenv("EMPANEL_FAULT_READ_COUNT", "1")
    for after in (1, 2, 3):  # a window's edge block (bounced) or its middle (in place)
        monkeypatch.setenv("EMPANEL_FAULT_READ_AFTER", str(after))
        llm = Llama(str(path), moe_slots="25%", moe_repack=repack, n_ctx=1024, logits_all=True, verbose=False,
                    moe_preload=False)
        try:
            with pytest.raises(MoeReadError, match="EMPANEL_FAULT_READ_AFTER"):
                run(llm)
            assert llm.n_tokens == 0
            again = run(llm)
            assert llm.moe_stats()["total"]["misses"] > 0
        finally:
            llm.close()
        assert np.array_equal(again, clean), after


@pytest.mark.parametrize("name", ["qwen3moe-q4_k", "qwen3moe-f32"])
@pytest.mark.usefixtures("read_io")  # on both read paths
def test_failed_overlapped_read_in_decode(fixture_dir, monkeypatch, name):
    """A decode read that fails while the layer's reads overlap its compute (the remap returned,
    a MUL_MAT_ID waits for its tensor): the first read of a token (its first tensor) or its last
    (a later tensor, waited for after another computed). The eval raises MoeReadError and takes
    in no token; decoding that token again gives the clean run's logits bit for bit, so no slot
    kept an expert whose bytes never landed."""
    path = model(fixture_dir, name)
    prompt = list(range(10, 19))
    n_decode = 8

    def decode(llm, fail_at=None):
        llm.reset()
        llm.eval(prompt)
        rows, reads = [], [llm.moe_stats()["total"]["n_reads"]]
        for k in range(n_decode):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if k == fail_at:
                n_before = llm.n_tokens
                with pytest.raises(MoeReadError, match="EMPANEL_FAULT_READ_AFTER"):
                    llm.eval([token])
                assert llm.n_tokens == n_before
            llm.eval([token])
            rows.append(np.array(llm.scores[llm.n_tokens - 1]))
            reads.append(llm.moe_stats()["total"]["n_reads"])
        return np.array(rows), reads, llm.moe_stats()["total"]

    def load():
        # (no read-ahead: its reads, dropped or not, would move the numbering of the demand reads)
        return Llama(str(path), moe_slots=4, moe_repack=False, moe_preload=False, moe_prefetch=0, n_ctx=256,
                     logits_all=True, verbose=False)

    llm = load()
    try:
        clean, reads, total = decode(llm)
    finally:
        llm.close()
    assert total["overlapped"] > 0, total
    # a token after the first two (its reads overlap) that reads something
    k = next(k for k in range(2, n_decode) if reads[k + 1] > reads[k])
    monkeypatch.setenv("EMPANEL_FAULT_READ_COUNT", "1")
    for after in (reads[k] + 1, reads[k + 1]):  # its first read request, its last
        monkeypatch.setenv("EMPANEL_FAULT_READ_AFTER", str(after))
        llm = load()
        try:
            again, _, _ = decode(llm, fail_at=k)
        finally:
            llm.close()
        assert np.array_equal(again, clean), after


# ------------------------------------------------------------------------------------------------
# 6. the guard's contract: the estimate is not below what the load really holds


_PEAK_AFTER_PROMPT_SCRIPT = """
import json, sys
from empanel_gguf import Llama
from empanel_gguf.planning.host_memory import proc_status
slots = json.loads(sys.argv[2])
llm = Llama(sys.argv[1], moe_slots=slots, n_ctx=512, n_batch=256, n_ubatch=256, n_threads=2,
            use_mmap=slots is not None, verbose=False)
llm.eval(llm.tokenize(b"the quick brown fox jumps over the lazy dog " * 30)[:256])
for _ in range(16):
    llm.eval([llm.sample(temp=0.0)])
print(json.dumps({"peak": proc_status()["VmHWM"]}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.skipif(bool(os.environ.get("EMPANEL_SANITIZER")),
                    reason="a sanitizer's shadow memory and quarantine are in the RSS (scripts/sanitize.sh)")
@pytest.mark.parametrize("moe_slots", [8, 64, None])
def test_estimate_holds_the_measured_peak_rss(fixture_dir, moe_slots):
    """The memory guard refuses by the estimate (plan.plan_load): a load, a 256-token prompt and a
    few decoded tokens must peak below it, with and without slot pools. The estimate is an upper
    bound, not a loose one: within 256 MiB of the measured peak here (the runtime allowance and
    the compute buffer bound are most of the slack)."""
    from empanel_gguf.planning.plan import plan_load

    path = model(fixture_dir, "qwen3moe-rss")
    index = load_index(path)
    kwargs = dict(n_ctx=512, n_batch=256, n_ubatch=256)
    est = plan_load(index, moe_slots, kwargs, available=1 << 50, floor=0).estimate
    peak = _child_json(_PEAK_AFTER_PROMPT_SCRIPT, path, json.dumps(moe_slots))["peak"]
    mib = 2**20
    print(f"\nmoe_slots={moe_slots}: peak RSS {peak / mib:.1f} MiB, estimate {est.host / mib:.1f} MiB "
          f"({est.describe()})")
    assert peak <= est.host
    assert est.host - peak < 256 * mib


# ------------------------------------------------------------------------------------------------
# 7. statistics are counters only; a preload that fails


def test_stats_reset_leaves_eviction_unchanged(fixture_dir):
    """lfu-decay's clock is the layer's own (micro-batches remapped), not its statistics: resetting
    the statistics mid-run changes no slot, no later hit or miss and no logit."""
    path = model(fixture_dir, "qwen3moe-f32")

    def run(reset):
        llm = Llama(str(path), moe_slots=4, moe_policy="lfu-decay", n_ubatch=1, **KW)
        try:
            tokens = llm.tokenize(PROMPT)
            llm.eval(tokens[:6])
            if reset:
                llm._experts.reset_stats()
            before = llm.moe_stats()["total"]
            llm.eval(tokens[6:])
            after = llm.moe_stats()["total"]
            return (after["hits"] - before["hits"], after["misses"] - before["misses"],
                    np.array(llm.scores[: llm.n_tokens], copy=True))
        finally:
            llm.close()

    hits, misses, logits = run(False)
    hits_reset, misses_reset, logits_reset = run(True)
    assert (hits, misses) == (hits_reset, misses_reset) and misses > 0
    assert np.array_equal(logits, logits_reset)


def test_stats_reset_leaves_the_lab_pool_unchanged():
    # the same through the sidecar's lab pools (the engine's code, no files): slot for slot
    from empanel_gguf.engine.pools import LabPool

    calls = [[0, 1], [1, 2], [0, 3], [4], [1, 4], [2, 5], [0, 1], [3, 6], [1, 7], [0, 2]] * 3
    plain, reset = LabPool("lfu-decay", [3], 8), LabPool("lfu-decay", [3], 8)
    for i, experts in enumerate(calls):
        if i == 7:
            reset.reset_stats()
        assert plain.access(0, experts) == reset.access(0, experts)
        assert plain.slot_table(0) == reset.slot_table(0)
    assert reset.stats(0)["n_remaps"] == len(calls) - 7


_PRELOAD_FAULT_SCRIPT = """
import json, os, sys
os.environ["EMPANEL_FAULT_READ_AFTER"] = "3"
from empanel_gguf import Llama, MoeReadError
try:
    Llama(sys.argv[1], moe_slots=16, moe_preload=True, n_ctx=64, verbose=False)
    out = {"raised": None}
except MoeReadError as e:
    out = {"raised": str(e)}
os.environ.pop("EMPANEL_FAULT_READ_AFTER")
llm = Llama(sys.argv[1], moe_slots=16, moe_preload=True, n_ctx=64, verbose=False)
out["preloaded"] = llm.moe_stats()["total"]["preloaded"]
llm.close()
print(json.dumps(out))
"""


@pytest.mark.usefixtures("read_io")  # on both read paths
def test_preload_failure_raises_and_frees_the_load(fixture_dir):
    """A read that fails while preloading (the 3rd request, EIO from the failpoint) makes the
    constructor raise MoeReadError with the reason; nothing of that load stays behind, and the
    next load in the same process preloads every expert."""
    path = model(fixture_dir, "qwen3moe-f32")
    out = _child_json(_PRELOAD_FAULT_SCRIPT, path)
    assert out["raised"] is not None and "preloading experts" in out["raised"]
    assert "EMPANEL_FAULT_READ_AFTER" in out["raised"]
    assert out["preloaded"] == 16 * len(load_index(path).layers)


_PREFETCH_FAULT_SCRIPT = """
import json, os, sys
from empanel_gguf import Llama, MoeReadError
path, after = sys.argv[1], int(sys.argv[2])
if after:
    os.environ["EMPANEL_FAULT_READ_AFTER"] = str(after)
llm = Llama(path, moe_slots=4, moe_prefetch=1, n_ctx=256, verbose=False)
llm.eval(llm.tokenize(b"Hello the world, and this is a test"))
out = {"raised": None, "n_tokens": None}
try:
    for i in range(40):
        n = llm.n_tokens
        llm.eval([llm.sample(temp=0.0)])
except MoeReadError as e:
    out["raised"], out["n_tokens"], out["before"] = str(e), llm.n_tokens, n
stats = llm.moe_stats()["total"]
out["n_reads"], out["prefetched"], out["beside"] = stats["n_reads"], stats["prefetched"], stats["prefetch_beside"]
llm.close()
print(json.dumps(out))
"""


@pytest.mark.usefixtures("read_io")  # on both read paths
def test_read_failure_while_reading_ahead_raises(fixture_dir):
    """A read that fails in a read-ahead batch (moe_prefetch=1, in flight beside the reads of the
    layer computing then: plain pools) or in a layer's own reads surfaces at the next remap or
    ready op: the decode raises MoeReadError and takes no token in."""
    path = model(fixture_dir, "qwen3moe-f32")
    ok = _child_json(_PREFETCH_FAULT_SCRIPT, path, 0)
    assert ok["raised"] is None and ok["prefetched"] > 0 and ok["beside"] > 0
    failed = _child_json(_PREFETCH_FAULT_SCRIPT, path, int(0.8 * ok["n_reads"]))
    assert failed["raised"] is not None and "EMPANEL_FAULT_READ_AFTER" in failed["raised"]
    assert failed["n_tokens"] == failed["before"]


def test_host_tier_rule():
    """moe_host_cache's rule: a size for pools in device memory; refused (saying why) where the
    pools are in host memory, and on a unified-memory device unless moe_host_cache_unified."""
    from empanel_gguf.planning.estimate import Estimate
    from empanel_gguf.planning.plan import host_cache_bytes

    def est(host_share):
        return Estimate(weights=1, experts=1, kv=1, compute=1, host_share=host_share, n_ctx=512, pooled=True)

    assert host_cache_bytes(None, est(0.0)) == 0
    assert host_cache_bytes("2GiB", est(0.0)) == 2 << 30
    assert host_cache_bytes(1 << 20, est(0.25)) == 1 << 20
    with pytest.raises(ValueError, match="pools are in host memory"):
        host_cache_bytes("2GiB", est(1.0))
    with pytest.raises(ValueError, match="shares host memory"):
        host_cache_bytes("2GiB", est(0.0), unified_devices=1)
    assert host_cache_bytes("2GiB", est(0.0), unified_devices=1, allow_unified=True) == 2 << 30
    with pytest.raises(ValueError, match="give a size"):
        host_cache_bytes("lots", est(0.0))
    # the estimate and the guard count it, in host memory
    e = est(0.0)
    e.host_cache = 3 << 30
    assert e.host == 1 + (3 << 30) and "host tier" in e.describe()


def test_host_tier_refused_on_a_cpu_build(fixture_dir):
    """On this build the pools are in host memory: moe_host_cache is refused, saying why."""
    path = model(fixture_dir, "qwen3moe-f16")
    with pytest.raises(ValueError, match="pools are in host memory"):
        Llama(str(path), moe_slots=4, moe_host_cache="64MiB", verbose=False)
