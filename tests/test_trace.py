"""Routing traces on the real engine: the Recorder's layout, the file round trip, the replay of the
engine's own policies against the engine's live counts, outputs unchanged by recording, what
recording costs, and the `trace` / `replay` commands end to end (fixture models, CPU)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env

from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.lab.replay import replay
from empanel_gguf.lab.bench.trace_overhead import measure_overhead
from empanel_gguf.lab.recorder import Recorder
from empanel_gguf.lab.trace import FORMAT_VERSION, TraceError, load_trace, save_trace

REPO = Path(__file__).resolve().parent.parent
NAME = "qwen3moe-f32"  # 3 MoE layers, 16 experts, top-4
PROMPT = b"The quick brown fox jumps over the lazy dog while the routing trace records every expert."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(fixtures.write_fixture(NAME, tmp_path_factory.mktemp("trace")))


def load(path, **kwargs):
    kwargs.setdefault("n_ctx", 256)
    return Llama(path, verbose=False, n_threads=1, n_threads_batch=1, **kwargs)


def record(path, n_decode=16, **kwargs):
    """A fresh load with moe_trace; prompt + greedy decode. Returns (trace, live stats or None).
    With slots, micro-batches fit the pools unless n_ubatch is given (then the engine may run
    waves)."""
    if kwargs.get("moe_slots") is not None:
        kwargs.setdefault("n_ubatch", max(1, kwargs["moe_slots"] // 4))
    kwargs.setdefault("moe_prefetch", 0)  # read-ahead makes hits of misses: the policy alone is replayed
    llm = load(path, moe_trace=True, **kwargs)
    try:
        rec = Recorder(llm, moe_slots=kwargs.get("moe_slots"), moe_policy=kwargs.get("moe_policy", "lru"))
        rec.prompt(llm.tokenize(PROMPT))
        rec.generate(n_decode, temperature=0.0, stop_at_eog=False)
        return rec.trace(), llm.moe_stats()
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------------
# the replay of the engine's own policy reproduces the engine's counts


@pytest.mark.parametrize("policy", ["lru", "lfu-decay", "g-lru"])
@pytest.mark.parametrize("slots", [6, 10])
def test_replay_reproduces_the_engine(model, policy, slots):
    # The engine counts every remap call, prompt and decode alike, from the moment the pools are
    # made; the trace starts at load as well, so the replay counts every call too (count="all";
    # warm + counted) at the recorded size, with the recorded micro-batches. Exact, not just
    # within a point: the replay mirrors remap.c's victim choice, ties and decay.
    trace, stats = record(model, moe_slots=slots, moe_policy=policy)
    assert trace.meta["engine_stats_from_load"]
    report = replay(trace, sizes=[slots], policies=[policy], count="all")
    r = report["results"][0]
    live = stats["total"]
    assert (r["total_hits"], r["total_misses"]) == (live["hits"], live["misses"])
    for layer, row in stats["layers"].items():
        assert r["layers"][str(layer)] == {"hits": row["hits"], "misses": row["misses"]}
    assert r["n_split_ubatches"] == 0
    # the check the replay command prints, from the stats stored in the trace
    assert report["engine_check"]["match"]
    live_rate = live["hits"] / (live["hits"] + live["misses"])
    assert abs(report["engine_check"]["replay_hit_rate"] - live_rate) < 0.01


@pytest.mark.parametrize("policy,guess", [("lru", True), ("lfu-decay", True), ("lfu-decay", False),
                                          ("g-lru", True)])
def test_replay_reproduces_the_engine_in_waves(model, policy, guess, monkeypatch):
    # stock micro-batches: the prompt's routes to more distinct experts than 6 slots hold, so the
    # engine runs it in waves; the replay plans the same waves (remap.c's own planner) and
    # reproduces every count (it split such micro-batches before: live and replay differed).
    # The prompt's read-ahead of the next layer is off: it makes hits of misses, which a replay
    # of the policy alone does not (engine_check says so, below)
    monkeypatch.setenv("EMPANEL_PROMPT_AHEAD", "0")
    trace, stats = record(model, moe_slots=6, moe_policy=policy, moe_guess=guess, n_ubatch=512)
    live = stats["total"]
    assert live["n_waves"] > live["n_remaps"]  # waves ran
    report = replay(trace, sizes=[6], policies=[policy], count="all")
    r = report["results"][0]
    assert (r["total_hits"], r["total_misses"]) == (live["hits"], live["misses"])
    for layer, row in stats["layers"].items():
        assert r["layers"][str(layer)] == {"hits": row["hits"], "misses": row["misses"]}
    assert report["engine_check"]["match"]
    if policy != "g-lru" and guess:  # with the prompt's read-ahead on (the default) there is no check
        monkeypatch.delenv("EMPANEL_PROMPT_AHEAD")
        trace, stats = record(model, moe_slots=6, moe_policy=policy, moe_guess=guess, n_ubatch=512)
        assert replay(trace, sizes=[6], policies=[policy], count="all")["engine_check"] is None


@pytest.mark.parametrize("policy", ["lru", "lfu-decay", "g-lru"])
@pytest.mark.parametrize("slots", [4, 7])
def test_policies_match_the_sidecar_call_by_call(model, policy, slots):
    # Random micro-batches (1-3 tokens of 4 distinct experts, skewed towards low ids so that
    # there are hits, ties and evictions) handed straight to the sidecar's remap; the Python
    # policy must count the same hits and misses on every call.
    import random

    from empanel_gguf.planning.index import load_index
    from empanel_gguf.lab.policies import make_policy

    index = load_index(model)
    llm = load(model, moe_slots=slots, moe_policy=policy)
    try:
        experts = llm._experts
        n, pool = experts.n, experts.pool
        ours = make_policy(policy, slots, n_expert=16, n_expert_used=4,
                           expert_bytes={il: index.layer(il).expert_bytes for il in index.moe_layers})
        max_tokens = max(1, ours.capacity() // 4)
        rng = random.Random(slots)
        weights = [1 / (e + 1) for e in range(16)]
        before = {il: (0, 0) for il in index.moe_layers}
        for _ in range(200):
            layer = rng.choice(index.moe_layers)
            rows = []
            for _ in range(rng.randint(1, max_tokens)):
                row = []
                while len(row) < 4:
                    e = rng.choices(range(16), weights)[0]
                    if e not in row:
                        row.append(e)
                rows.append(row)
            flat = [e for row in rows for e in row]
            ids = n.ffi.new("int32_t[]", flat)
            out = n.ffi.new("int32_t[]", len(flat))
            assert n.sidecar.empanel_remap(pool, layer, n.ffi.NULL, 0, 1, ids, 4, out, 4, len(rows)) == 0
            row = experts.stats()["layers"][layer]
            live = (row["hits"] - before[layer][0], row["misses"] - before[layer][1])
            before[layer] = (row["hits"], row["misses"])
            assert ours.access(layer, flat) == live
    finally:
        llm.close()


def test_replay_reproduces_the_engine_with_a_leading_dense_layer(tmp_path_factory):
    # deepseek2: layer 0 is dense, MoE layers 1 and 2; top-4 of 16 in groups
    path = str(fixtures.write_fixture("deepseek2", tmp_path_factory.mktemp("trace-ds2")))
    trace, stats = record(path, n_decode=8, moe_slots=8, moe_policy="lru")
    assert trace.moe_layers == [1, 2]
    r = replay(trace, sizes=[8], policies=["lru"], count="all")["results"][0]
    assert (r["total_hits"], r["total_misses"]) == (stats["total"]["hits"], stats["total"]["misses"])


# ------------------------------------------------------------------------------------------------
# the trace itself


def test_trace_layout(model):
    trace, _ = record(model, moe_slots=8)
    n_prompt = trace.n_prompt
    assert trace.n_decode == 16 and n_prompt > 16
    assert trace.experts.dtype == np.int16 and trace.experts.shape == (trace.n_tokens, 3, 4)
    assert list(trace.prompt) == [True] * n_prompt + [False] * 16
    # record() runs micro-batches of 8 // 4 = 2 tokens (they fit the pool, as the replay lab
    # models); decode micro-batches hold one token each
    assert trace.meta["recorded_with"]["n_ubatch"] == 2
    assert trace.ubatch.sum() == trace.n_tokens and trace.ubatch.max() == 2
    assert list(trace.ubatch[-16:]) == [1] * 16
    # layers 0 and 1 ran every token; the last layer only the prompt's last token and the decodes
    assert (trace.experts[:, :2] >= 0).all()
    last = trace.experts[:, 2, 0] >= 0
    assert list(np.flatnonzero(last)) == [n_prompt - 1] + list(range(n_prompt, trace.n_tokens))
    assert ((trace.experts >= 0) | (trace.experts == -1)).all() and trace.experts.max() < 16
    # top-k distinct per token and layer
    for t, j in zip(*np.nonzero(trace.experts[:, :, 0] >= 0)):
        assert len(set(trace.experts[t, j].tolist())) == 4
    meta = trace.meta
    assert meta["n_expert"] == 16 and meta["n_expert_used"] == 4 and meta["moe_layers"] == [0, 1, 2]
    assert len(meta["expert_bytes"]) == 3 and all(b > 0 for b in meta["expert_bytes"])
    assert meta["recorded_with"]["slots"] == 8 and meta["router_scores"] is False
    assert [s["kind"] for s in meta["segments"]] == ["prompt", "decode"]


def test_routing_is_the_same_without_slots(model):
    # slot pools change which slot holds an expert, never the routing: the decode tokens route
    # the same (greedy; n_ubatch differs, so only the decode phase is compared)
    with_slots, _ = record(model, moe_slots=8)
    without, stats = record(model)
    assert stats is None or not stats["layers"]
    assert without.meta["recorded_with"]["slots"] is None and without.meta["engine_stats"] is None
    assert np.array_equal(with_slots.tokens, without.tokens)
    d = ~with_slots.prompt
    assert np.array_equal(with_slots.experts[d], without.experts[d])


def test_records_taken_in_pieces_lay_out_the_same(model, monkeypatch):
    # the Recorder takes the sidecar's records after each prompt and every TAKE_EVERY decode
    # evaluations; how often it takes them changes nothing
    from empanel_gguf.lab import recorder as recorder_module

    whole, _ = record(model, moe_slots=8)
    monkeypatch.setattr(recorder_module, "TAKE_EVERY", 3)
    pieces, _ = record(model, moe_slots=8)
    for name in ("experts", "prompt", "tokens", "ubatch", "calls"):
        assert np.array_equal(getattr(whole, name), getattr(pieces, name)), name


def test_trace_file_round_trip(model, tmp_path):
    trace, _ = record(model, moe_slots=6, moe_policy="lfu-decay")
    path = save_trace(trace, tmp_path / "t.npz")
    back = load_trace(path)
    for name in ("experts", "prompt", "tokens", "segment", "ubatch", "calls"):
        a, b = getattr(trace, name), getattr(back, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert back.meta == json.loads(json.dumps(trace.meta))
    assert back.meta["version"] == FORMAT_VERSION and back.meta["recorded_with"]["moe_policy"] == "lfu-decay"
    # a file without an extension stays where it was asked to go
    assert save_trace(trace, tmp_path / "plain").exists()
    # not a trace, another version
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceError):
        load_trace(tmp_path / "junk.npz")
    meta = dict(trace.meta, version=FORMAT_VERSION + 1)
    with open(tmp_path / "v2.npz", "wb") as f:
        np.savez(f, meta=np.array(json.dumps(meta)), experts=trace.experts, prompt=trace.prompt,
                 tokens=trace.tokens, segment=trace.segment, ubatch=trace.ubatch, calls=trace.calls)
    with pytest.raises(TraceError, match="version"):
        load_trace(tmp_path / "v2.npz")


# ------------------------------------------------------------------------------------------------
# recording changes nothing, and costs little


@pytest.mark.parametrize("slots", [None, 8])
def test_recording_does_not_change_outputs(model, slots):
    out = {}
    for traced in (False, True):
        llm = load(model, moe_slots=slots, moe_trace=traced, logits_all=True)
        try:
            tokens = llm.tokenize(PROMPT)
            llm.eval(tokens)
            for _ in range(6):  # greedy decode, every step's logits kept
                llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
            out[traced] = (llm.context_params.n_ubatch, np.array(llm.scores[:llm.n_tokens]),
                           list(llm.input_ids[:llm.n_tokens]))
            if traced:
                assert len(llm.moe_take_trace()) > 0
        finally:
            llm.close()
    assert out[False][0] == out[True][0]  # the same micro-batch size
    assert out[False][2] == out[True][2]
    assert np.array_equal(out[False][1], out[True][1])  # bit-identical logits, every token


def test_overhead_measurement_runs_the_same_evaluations(model):
    # What tracing costs is a benchmark figure (`empanel-gguf trace --overhead`), not a test
    # threshold: this machine is shared. Here: the recorder accounts for its own time, and the
    # measurement replays the recorded schedule on fresh loads, with and without tracing.
    llm = load(model, moe_trace=True, moe_slots=8)
    try:
        rec = Recorder(llm)
        rec.prompt(llm.tokenize(PROMPT))
        rec.generate(8, stop_at_eog=False)
        assert rec.eval_s > 0 and 0 <= rec.trace_s
        schedule = rec.schedule()
    finally:
        llm.close()
    result = measure_overhead(model, schedule, repeats=1, n_ctx=256, n_threads=1, n_threads_batch=1,
                              moe_slots=8)
    assert result["traced_s"] > 0 and result["plain_s"] > 0 and result["repeats"] == 1
    assert result["overhead"] == pytest.approx(result["traced_s"] / result["plain_s"] - 1)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "empanel_gguf"] + [str(a) for a in args], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=120)


def test_trace_then_replay_commands(model, tmp_path):
    out = tmp_path / "run.npz"
    proc = cli("trace", model, "-o", out, "-p", "Once upon a time there was", "-n", 12,
               "--moe-slots", 8, "--moe-policy", "g-lru", "-t", 1, "-tb", 1, "-ub", 2)
    assert proc.returncode == 0, proc.stderr
    assert "decode tokens" in proc.stdout and "router scores not recorded" in proc.stdout
    trace = load_trace(out)
    assert trace.n_decode == 12 and trace.meta["recorded_with"]["moe_policy"] == "g-lru"

    proc = cli("replay", out, "--slots", "4,8,50%", "--policies", "lru,g-lru,belady", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["sizes"] == [4, 8] and report["count"] == "decode"
    assert [(r["policy"], r["slots"]) for r in report["results"]] == [
        ("lru", 4), ("lru", 8), ("g-lru", 4), ("g-lru", 8), ("belady", 4), ("belady", 8)]
    rates = {(r["policy"], r["slots"]): r["hit_rate"] for r in report["results"]}
    assert rates[("belady", 8)] >= rates[("lru", 8)]
    for r in report["results"]:
        assert r["hits"] + r["misses"] > 0 and r["missed_bytes_per_token"] >= 0
        assert r["ceiling_tok_s"] is None or r["ceiling_tok_s"] > 0
    assert report["engine_check"]["policy"] == "g-lru" and report["engine_check"]["match"]

    proc = cli("replay", out, "--slots", "8", "--gbps", "2.5")
    assert proc.returncode == 0, proc.stderr
    assert "ceiling @ 2.5 GB/s" in proc.stdout and "belady" in proc.stdout and ": match" in proc.stdout

    png = tmp_path / "curve.png"
    proc = cli("replay", out, "--slots", "4,6,8", "--plot", png)
    if importlib.util.find_spec("matplotlib") is None:
        assert proc.returncode == 1 and "matplotlib" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert cli("replay", tmp_path / "missing.npz").returncode == 1


def test_trace_command_chat_and_document(model, tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "user", "content": "And a shape?"},
        {"role": "assistant", "content": "A circle."},
        {"role": "user", "content": "Thanks."},
    ]))
    out = tmp_path / "chat.npz"
    proc = cli("trace", model, "-o", out, "--chat", chat, "-n", 6, "--moe-slots", "none", "-t", 1)
    assert proc.returncode == 0, proc.stderr
    trace = load_trace(out)
    segments = [(s["kind"], s["role"]) for s in trace.meta["segments"]]
    # user turn, generated reply, user turn, the given reply fed as prompt, user turn, reply
    assert segments == [("prompt", "user"), ("decode", "assistant"), ("prompt", "user"),
                        ("prompt", "assistant"), ("prompt", "user"), ("decode", "assistant")]
    assert trace.n_decode == 12 and trace.meta["engine_stats"] is None
    # the given assistant text is in the trace's tokens as prompt tokens
    llm = load(model)
    try:
        given = llm.tokenize(b"A circle.", add_bos=False)
        fed = trace.tokens[trace.segment == 3].tolist()
    finally:
        llm.close()
    assert fed == given and not trace.prompt[trace.segment == 1].any()

    doc = tmp_path / "doc.txt"
    doc.write_text("A long document. " * 200)
    out = tmp_path / "doc.npz"
    proc = cli("trace", model, "-o", out, "-f", doc, "-n", 0, "-c", 128, "-t", 1)
    assert proc.returncode == 0, proc.stderr
    assert "first 128" in proc.stderr
    trace = load_trace(out)
    assert trace.n_prompt == 128 and trace.n_decode == 0
    # no decode tokens: the replay counts every call and says so
    proc = cli("replay", out, "--slots", "8", "--policies", "lru")
    assert proc.returncode == 0 and "counting every call" in proc.stdout


def test_plot_without_matplotlib_says_so(model, tmp_path, monkeypatch, capsys):
    import importlib.util

    from empanel_gguf.commands import replay as replay_command

    trace, _ = record(model, n_decode=4, moe_slots=8)
    path = save_trace(trace, tmp_path / "t.npz")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    assert replay_command.main([str(path), "--plot", str(tmp_path / "p.png")]) == 1
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_a_failed_read_keeps_what_was_recorded(model, tmp_path):
    # the model file is cut short while loaded: the decode that misses raises MoeReadError (its
    # KV cache rolled back); the trace keeps every evaluation before it and drops its records
    import shutil

    from empanel_gguf import MoeReadError

    path = tmp_path / "model.gguf"
    shutil.copy(model, path)
    llm = load(str(path), moe_trace=True, moe_slots=4)
    try:
        rec = Recorder(llm)
        rec.prompt(llm.tokenize(PROMPT))
        os.truncate(path, path.stat().st_size // 2)
        with pytest.raises(MoeReadError):
            rec.generate(64, stop_at_eog=False)
        trace = rec.trace()
        n_decoded = llm.n_tokens - trace.n_prompt
    finally:
        llm.close()
    assert trace.n_decode == n_decoded and trace.n_tokens == trace.ubatch.sum()
    assert (trace.experts[~trace.prompt] >= 0).all()


def test_guesses_are_recorded_and_round_trip(model, tmp_path):
    """With slots the engine's gate-ahead guesses go into the trace (version 2): every decoded
    token has one in each MoE layer after the first; none in the first; they survive save/load."""
    trace, _ = record(model, moe_slots=8)
    assert trace.guesses is not None and trace.guesses.shape == trace.experts.shape
    decode = ~trace.prompt
    assert (trace.guesses[decode, 0] == -1).all()          # nothing guesses the first MoE layer
    assert (trace.guesses[decode, 1:] >= 0).all()          # every later one, for every decoded token
    loaded = load_trace(save_trace(trace, tmp_path / "g.npz"))
    assert np.array_equal(loaded.guesses, trace.guesses) and loaded.meta["version"] == FORMAT_VERSION == 2
    unguessed, _ = record(model, moe_slots=8, moe_guess=False)
    assert unguessed.guesses is None and load_trace(save_trace(unguessed, tmp_path / "u.npz")).guesses is None
