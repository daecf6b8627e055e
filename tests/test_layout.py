"""The weight layout by measurement: `empanel-gguf layout` runs both layouts in fresh processes,
saves the decision per machine and model, and moe_repack="auto" follows it, exactly as the stock
layout it names; a damaged file keeps the rule and says so."""

import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.lab.exactness import greedy_logits
from empanel_gguf.models import fixtures
from empanel_gguf.planning.index import load_index
from empanel_gguf.planning.layout import RULE_PAGED, decide, load_probe, machine, probe_path, save_probe

# Q2_K experts (repacked on AVX-512 only): the sidecar's own Q2_K repack, the q4_k fixture's shape
Q2_K = fixtures.FixtureSpec("qwen3moe-q2_k", "qwen3moe", n_layer=2, n_expert=8, n_expert_used=2, n_embd=256,
                            n_ff_exp=256, weight_type="F16", requantize_to="Q2_K", seed=5)
TEXT = b" ".join(b"%d layouts by measurement" % i for i in range(12))


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("layout-fixtures")


@pytest.fixture
def profiles(tmp_path, monkeypatch):
    """A cache folder of this test's own (the suite's shared one keeps no layout)."""
    folder = tmp_path / "profiles"
    monkeypatch.setenv("EMPANEL_PROFILE_DIR", str(folder))
    return folder


def layout_cmd(*args):
    return subprocess.run([sys.executable, "-m", "empanel_gguf", "layout", *map(str, args)], capture_output=True,
                          text=True, env=os.environ.copy(), timeout=600)


def run(path, n_ctx=512, **kwargs):
    llm = Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False, **kwargs)
    try:
        logits, tokens = greedy_logits(llm, TEXT, 4)
        return logits, tokens, llm.moe_stats()
    finally:
        llm.close()


def rounds(*decode, prompt=100.0):
    return [{"decode_tps": d, "prompt_tps": prompt} for d in decode]


def test_decision_needs_a_clear_win_in_every_round():
    """Repacked only where its decode median wins by 5 % and every round beats every plain round,
    with its prompts at least 0.8 of plain's; anything closer keeps plain."""
    plain = rounds(10.0, 10.2, 9.9)
    assert decide(plain, rounds(11.0, 11.2, 10.9))[0] == "repacked"
    assert decide(plain, rounds(11.0, 11.2, 10.9, prompt=94.0))[0] == "repacked"  # a short prompt's noise
    assert decide(plain, rounds(10.4, 10.6, 10.3))[0] == "plain"            # 1.04x: noise
    assert decide(plain, rounds(11.0, 11.2, 10.1))[0] == "plain"            # one round within plain's
    assert decide(plain, rounds(11.0, 11.2, 10.9, prompt=75.0))[0] == "plain"  # prompts 25 % slower
    decision, why = decide(plain, rounds(7.0, 7.1, 6.9))
    assert decision == "plain" and why.startswith("measured:") and "0.70x" in why and "medians of 3" in why


def test_probe_measures_saves_and_auto_follows(fixture_dir, profiles):
    """Two rounds of both layouts on a Q4_0 model at 4 of 16 slots: the decision and every round's
    numbers are saved for this machine; a load with moe_repack auto then takes that layout and
    quotes the measurement, exact to the stock command it names; --show prints it, --forget
    removes it and the rule is back."""
    path = fixtures.write_fixture("qwen3moe-q4_0", fixture_dir)
    got = layout_cmd(path, "--moe-slots", 4, "-p", 16, "-n", 8, "-r", 2)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "decision" in got.stdout and "round 2 repacked" in got.stderr, got.stdout + got.stderr
    index = load_index(path)
    entry = load_probe(index)
    assert entry["machine"]["key"] == machine()["key"] and entry["moe_slots"] == 4
    assert len(entry["runs"]["plain"]) == len(entry["runs"]["repacked"]) == 2
    for name, runs in entry["runs"].items():
        assert all(r["layout"] == name and r["decode_tps"] > 0 and r["prompt_tps"] > 0 for r in runs)
        assert all(r["bytes_read"] > 0 for r in runs)  # the pools paged in both
    assert all(r["repacked_bytes"] == 0 for r in entry["runs"]["plain"])
    repacks = entry["runs"]["repacked"][0]["repacked_bytes"] > 0  # Q4_0 repacks where ggml has AVX2 or SVE kernels
    assert (entry["repack_gbps"] or 0) > 0 if repacks else entry["decision"] == "plain"
    assert entry["decision"] == decide(entry["runs"]["plain"], entry["runs"]["repacked"])[0] or not repacks

    logits, tokens, stats = run(path, moe_slots=4)
    assert stats["layout"] == entry["decision"]
    assert stats["layout_why"].startswith(entry["why"]) and entry["date"][:10] in stats["layout_why"]
    ref, ref_tokens, _ = run(path, **stats["exact_kwargs"])
    assert tokens == ref_tokens and np.array_equal(logits, ref), np.abs(logits - ref).max()

    shown = layout_cmd(path, "--show")
    assert shown.returncode == 0 and f"decision  {entry['decision']}" in shown.stdout, shown.stdout + shown.stderr
    assert layout_cmd(path, "--forget").returncode == 0 and not probe_path(index).exists()
    assert run(path, moe_slots=4)[2]["layout_why"] == RULE_PAGED


@pytest.mark.parametrize("name", ["qwen3moe-q4_0", "qwen3moe-q4_k", "qwen3moe-q2_k"])
def test_auto_follows_a_saved_repacked_layout_exactly(fixture_dir, profiles, monkeypatch, name):
    """A saved decision for repacked pools (another run of the probe on this machine) makes paging
    pools repacked: the readers repack what they read (Q4_K and Q2_K by the sidecar's own repack
    on x86, Q4_0 by ggml's), and the logits equal stock's defaults bit for bit, prompt waves and decode
    included; with ggml's repack only (EMPANEL_REPACK=ggml) they are the same."""
    path = (fixtures.write_fixture(name, fixture_dir) if name in fixtures.FIXTURES else
            fixtures.write_model(Q2_K, fixture_dir / f"{name}.gguf"))
    index = load_index(path)
    save_probe(index, {"machine": machine(), "date": "2026-12-06T00:00:00+00:00", "moe_slots": 4, "runs": {},
                       "decision": "repacked", "why": "measured: repacked pools faster here (a test's entry)"})
    logits, tokens, stats = run(path, moe_slots=4)
    assert stats["layout"] == "repacked" and "a test's entry" in stats["layout_why"]
    assert stats["exact_kwargs"]["moe_repack"] is True and "--no-repack" not in stats["exact_to"]
    far = run(path, moe_slots=6)[2]  # a measurement at 4 slots says nothing of 6: the rule
    assert far["layout"] == "plain" and "at 4 slots per layer, far from this load's 6" in far["layout_why"]
    assert stats["total"]["misses"] > 0 and stats["total"]["n_waves"] > stats["total"]["n_remaps"]
    if stats["total"]["repack_bytes"] == 0:
        pytest.skip(f"ggml repacks no {name.split('-')[1]} on this CPU: both layouts are plain")
    assert stats["total"]["repack_s"] > 0
    ref, ref_tokens, _ = run(path, **stats["exact_kwargs"])
    assert tokens == ref_tokens and np.array_equal(logits, ref), np.abs(logits - ref).max()
    if name != "qwen3moe-q4_0" and platform.machine() in ("x86_64", "AMD64"):
        # the sidecar's own K-quant repack wrote all but each tensor's first expert (checked against ggml's)
        assert 0 < stats["total"]["repack_own_bytes"] < stats["total"]["repack_bytes"], stats["total"]
    monkeypatch.setenv("EMPANEL_REPACK", "ggml")  # ggml's repack only: the same logits
    got, got_tokens, ggml_stats = run(path, moe_slots=4)
    assert ggml_stats["total"]["repack_own_bytes"] == 0 and ggml_stats["total"]["repack_bytes"] > 0
    assert got_tokens == tokens and np.array_equal(got, logits)


def test_damaged_layout_file_keeps_the_rule_and_says_so(fixture_dir, profiles, capfd):
    """A layout file that is not JSON, or names no known layout, is reported (whatever verbose is)
    and the rule chooses: the load goes on."""
    path = fixtures.write_fixture("qwen3moe-q4_0", fixture_dir)
    index = load_index(path)
    file = probe_path(index)
    file.parent.mkdir(parents=True, exist_ok=True)
    for text in ("{not json", json.dumps({"machines": {machine()["key"]: {"decision": "sideways"}}})):
        file.write_text(text)
        capfd.readouterr()
        stats = run(path, moe_slots=4)[2]
        err = capfd.readouterr().err
        assert stats["layout"] == "plain" and stats["layout_why"] == RULE_PAGED
        assert "unreadable" in err or "neither plain nor repacked" in err, err[-2000:]


def test_nothing_to_measure_where_no_pool_pages(fixture_dir, profiles):
    """Pools that hold every expert take stock's defaults by rule: the probe says so, saves nothing."""
    path = fixtures.write_fixture("qwen3moe-q4_0", fixture_dir)
    got = layout_cmd(path, "--moe-slots", 16, "-r", 1)
    assert got.returncode == 0 and "nothing to measure" in got.stdout, got.stdout + got.stderr
    assert not probe_path(load_index(path)).exists()
    bad = layout_cmd(path, "-n", 0)
    assert bad.returncode == 1 and "at least 1" in bad.stderr


def test_probe_under_a_cap_runs_in_its_memory(fixture_dir, profiles):
    """`layout --cap` measures where a container's limit will hold the model (64-2): every run
    loads in a memory cgroup of that limit (its plan sees no more), the entry and a later load's
    layout_why say the cap; a cap that is neither a share nor a size is an error."""
    from empanel_gguf.lab.bench.host import MemCgroup

    try:
        MemCgroup(f"empanel-layout-check-{os.getpid()}").remove()
    except OSError as e:
        if os.environ.get("EMPANEL_REQUIRE_CGROUP") == "1":
            pytest.fail(f"EMPANEL_REQUIRE_CGROUP=1 but no memory cgroup of our own: {e}", pytrace=False)
        pytest.skip(f"no memory cgroup of our own (root, cgroup v1): {e}")
    path = fixtures.write_fixture("qwen3moe-q4_0", fixture_dir)
    cap = 900 << 20
    got = layout_cmd(path, "--moe-slots", 4, "-p", 16, "-n", 8, "-r", 1, "--cap", "900MiB")
    assert got.returncode == 0, got.stderr[-3000:]
    assert "under a 0.88 GiB cap" in got.stdout, got.stdout
    entry = load_probe(load_index(path))
    assert entry["cap_bytes"] == cap
    for runs in entry["runs"].values():
        assert all(0 < r["available"] <= cap for r in runs), runs  # each plan saw the cgroup's limit
    stats = run(path, moe_slots=4)[2]
    assert "under a 0.88 GiB cap" in stats["layout_why"], stats["layout_why"]
    for bad in ("1.5", "lots"):
        got = layout_cmd(path, "--moe-slots", 4, "--cap", bad)
        assert got.returncode == 1 and "--cap" in got.stderr, got.stderr
