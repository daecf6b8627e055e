"""The plan a load's pools are made from (csrc/plan_file.c): records out of bounds refused, pools
checked against it at the bind, the files' identity checked when llama.cpp opens them, reader
start failures, and the fuzzer (scripts/fuzz_plan.py) bounded: mutated plans end in a clear error
or a load that works, never a crash or a hang. scripts/sanitize.sh runs these under ASan + UBSan
and TSan."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.engine import pools
from empanel_gguf.engine.native import NativeLibraryError, native

REPO = Path(__file__).resolve().parent.parent
SANITIZED = bool(os.environ.get("EMPANEL_SANITIZER"))


def test_mutated_plans_fail_clearly_and_never_crash(tmp_path_factory):
    model = fixtures.write_fixture("qwen3moe-f32", tmp_path_factory.mktemp("plan-fuzz-model"))
    work = tmp_path_factory.mktemp("plan-fuzz")
    cases, seconds = (120, 150) if SANITIZED else (200, 120)
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fuzz_plan.py"), str(model), "--cases", str(cases), "--seed", "1",
         "--seconds", str(seconds), "--case-timeout", "120", "--workdir", str(work), "--json", str(work / "out.json")],
        capture_output=True, text=True, timeout=seconds + 400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((work / "out.json").read_text())
    assert summary["findings"] == []
    assert summary["cases"] >= 40, summary
    opened = summary["outcomes"]["open"]
    # the mutations reach both sides: plans refused with a reason, and plans that still open and load
    assert opened.get("error", 0) > 0 and opened.get("ok", 0) > 0, opened
    assert summary["outcomes"].get("load", {}).get("ok", 0) > 0, summary["outcomes"]


# ------------------------------------------------------------------------------------------------
# the plan's bounds, the pools' shapes and the files' identity, each on its own

NAME = "qwen3moe-f32"  # 16 experts, top-4, F32 experts of 8192 bytes


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return fixtures.write_fixture(NAME, tmp_path_factory.mktemp("plan"))


@pytest.fixture(scope="module")
def good_plan(model_path):
    sys.path.insert(0, str(REPO / "scripts"))
    from fuzz_plan import base_plan

    return base_plan(model_path)


def open_plan(text, model_path):
    """empanel_load_open on the plan text: None if it opened (and was closed), else its error."""
    n = native()
    err = n.ffi.new("char[]", 512)
    load = n.sidecar.empanel_load_open(text.encode(), n.ffi.NULL, str(model_path).encode(), err, 512)
    if load == n.ffi.NULL:
        return n.ffi.string(err).decode()
    n.sidecar.empanel_load_close(load)
    return None


def load_with_plan(text, model_path, monkeypatch, **kwargs):
    """A Llama load whose pools come from this plan text (instead of the one planned for it)."""
    monkeypatch.setattr(pools, "load_text", lambda load, *args, **kw: text)
    return Llama(str(model_path), moe_slots=4, n_ctx=64, verbose=False, **kwargs)


def record(text, kind, index=0):
    return [line for line in text.splitlines() if line.startswith(kind + " ")][index]


def with_record(text, old, new):
    assert old in text
    return text.replace(old, new, 1)


def test_plan_records_out_of_bounds_are_refused(good_plan, model_path):
    tensor = record(good_plan, "tensor").split(" ")  # tensor <layer> <file> <offset> <expert_size> <name>
    params = record(good_plan, "params").split(" ")  # params <n_threads> <chunk_bytes> ...
    shape = record(good_plan, "shape")

    def tensor_with(offset=None, size=None, file=None):
        fields = list(tensor)
        fields[2] = file if file is not None else fields[2]
        fields[3] = offset if offset is not None else fields[3]
        fields[4] = size if size is not None else fields[4]
        return with_record(good_plan, " ".join(tensor), " ".join(fields))

    def params_with(i, value):
        fields = list(params)
        fields[i] = value
        return with_record(good_plan, " ".join(params), " ".join(fields))

    cases = {
        # offset + 16 x 8192 wraps past 2^64 and lands "inside" the file: refused before any sum
        "lie outside its file": tensor_with(offset=str(2**64 - 8192)),
        "lie outside its file ": tensor_with(size=str(2**60)),            # 16 x 2^60 wraps to 0
        "a bad 'tensor' record": tensor_with(size="0"),
        "a bad 'tensor' record ": tensor_with(file="1"),                  # one file only
        "a bad 'params' record": params_with(1, str(2**31 - 1)),          # reader threads
        "a bad 'params' record ": params_with(2, str(2**31)),             # bytes per read request
        "fewer than the 4 experts a token uses": with_record(good_plan, "\nslots 4 4 4\n", "\nslots 4 3 4\n"),
    }
    assert shape == "shape 3 16 4", shape
    for expected, text in cases.items():
        err = open_plan(text, model_path)
        assert err is not None and expected.strip() in err, (expected, err)
    assert open_plan(good_plan, model_path) is None


def test_bind_checks_each_pool_against_the_plan(good_plan, model_path, monkeypatch):
    """A plan whose experts are half their real size opens (it lies inside the file), but
    llama.cpp's pools hold 8192 bytes a slot: the bind refuses it instead of reading 4096 bytes
    into each slot (and giving back memory by them)."""
    tensor = record(good_plan, "tensor")
    half = tensor.replace(" 8192 ", " 4096 ")
    text = with_record(good_plan, tensor, half)
    assert open_plan(text, model_path) is None
    with pytest.raises(NativeLibraryError, match=r"slot pool has 4 slots of 8192 bytes, the plan 4 of 4096"):
        load_with_plan(text, model_path, monkeypatch)


def test_too_few_slots_for_a_token_fail_the_load_not_the_graph(good_plan, model_path, monkeypatch):
    """The plan says top-2 and pages with 2 slots, the model routes 4 experts a token: llama.cpp's
    load fails with an error (before: an assertion in the graph aborted the process)."""
    text = with_record(with_record(good_plan, "\nshape 3 16 4\n", "\nshape 3 16 2\n"),
                       "\nslots 4 4 4\n", "\nslots 4 2 4\n")
    assert open_plan(text, model_path) is None
    with pytest.raises(ValueError):
        load_with_plan(text, model_path, monkeypatch)


def test_a_file_replaced_between_the_two_opens_is_refused(model_path, tmp_path, monkeypatch):
    """The sidecar opens the file before llama.cpp does: a copy renamed over the path in between
    (the same bytes, another file) would give the dense weights of one file and the experts of
    another. The bind compares the files llama.cpp read with its own, by device and inode."""
    path = tmp_path / "model.gguf"
    shutil.copy(model_path, path)
    begin = pools.ExpertPools.begin

    def begin_then_replace(self):
        begin(self)
        shutil.copy(model_path, tmp_path / "other.gguf")
        os.replace(tmp_path / "other.gguf", path)

    monkeypatch.setattr(pools.ExpertPools, "begin", begin_then_replace)
    with pytest.raises(NativeLibraryError, match="was replaced between empanel-gguf's open and llama.cpp's"):
        Llama(str(path), moe_slots=4, n_ctx=64, verbose=False)
    monkeypatch.setattr(pools.ExpertPools, "begin", begin)
    Llama(str(path), moe_slots=4, n_ctx=64, verbose=False).close()  # the file itself loads


def _vm_size():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("read_io, failing, of", [("threads", 3, 8), ("uring", 0, 1)])
def test_reader_threads_that_fail_to_start_say_so_and_leak_nothing(good_plan, model_path, monkeypatch, read_io,
                                                                   failing, of):
    """Reader thread 3 of 8 (io_uring: its one thread) fails to start (EMPANEL_FAULT_THREAD_START:
    pthread_create's EAGAIN): the message names it with pthread_create's own error, the started
    threads are joined, and every read buffer (and the ring) is freed, those of the threads that
    never started included."""
    if read_io == "uring":
        from conftest import require_uring

        require_uring()
    monkeypatch.setenv("EMPANEL_READ_IO", read_io)
    monkeypatch.setenv("EMPANEL_FAULT_THREAD_START", str(failing))
    params = record(good_plan, "params").split(" ")
    params[1] = "8"
    text = with_record(good_plan, record(good_plan, "params"), " ".join(params))
    err = open_plan(text, model_path)
    assert err == f"empanel: cannot start reader thread {failing} of {of}: Resource temporarily unavailable", err
    if SANITIZED or not Path("/proc/self/status").exists():
        return  # the sanitizer's allocator keeps freed memory aside (VmSize says nothing)
    for _ in range(20):
        open_plan(text, model_path)
    before = _vm_size()
    for _ in range(200):  # 5 unstarted threads' buffers (264 KiB each) per try were lost: 260 MiB
        open_plan(text, model_path)
    assert _vm_size() - before < 32 << 20, (before, _vm_size())


def test_switches_as_text_and_the_guess_rule():
    """A switch given as text from Python reads as its flag does ("off" is off, never a true
    string); moe_guess auto is on, except where RPC servers are registered (a guess computed on a
    host costs a round trip per layer to read back)."""
    from empanel_gguf.planning import estimate
    from empanel_gguf.planning.options import moe_options
    from empanel_gguf.planning.plan import resolve_guess

    options = moe_options(moe_guess="off", moe_verify="off", moe_elastic="auto")
    assert options.guess is False and options.verify is False and options.elastic is None
    with pytest.raises(ValueError, match="moe_verify='maybe'"):
        moe_options(moe_verify="maybe")
    saved = estimate._rpc_probe
    try:
        estimate.set_rpc_probe(lambda: False)
        assert resolve_guess(None) is True and resolve_guess(False) is False
        estimate.set_rpc_probe(lambda: True)
        assert resolve_guess(None) is False and resolve_guess(True) is True
    finally:
        estimate.set_rpc_probe(saved)
