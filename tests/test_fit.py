"""`empanel-gguf fit` (lab/fit.py): predicted speed and memory per budget, from one measured run."""

import json
import subprocess
import sys

import pytest

from empanel_gguf.commands.options import BUILTIN_MODEL
from empanel_gguf.lab.fit import MAX_DECODE, MIN_READ_BYTES, measure, predict
from empanel_gguf.lab.replay import replay
from empanel_gguf.lab.trace import load_trace
from empanel_gguf.planning.estimate import estimate
from empanel_gguf.planning.index import load_index
from empanel_gguf.planning.plan import ESTIMATE_KWARGS
from empanel_gguf.planning.sizing import plan_slots

from conftest import child_env


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMPANEL_PROFILE_DIR", str(tmp_path / "cache"))  # each test's own measurements


def _builtin():
    if not BUILTIN_MODEL.is_file():
        pytest.skip("the built-in model is not in this checkout")
    return BUILTIN_MODEL


def _fit(*args, cache):
    env = child_env(EMPANEL_PROFILE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "empanel_gguf", "fit", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_fit_json_rows_follow_memory_and_are_saved(tmp_path):
    model = _builtin()
    index = load_index(model)
    out = _fit(model, "-t", "2", "--json", cache=tmp_path / "c")
    assert out.returncode == 0, out.stderr
    assert "fit: measuring" in out.stderr
    report = json.loads(out.stdout)
    rows, m = report["rows"], report["measurement"]
    assert [r["label"] for r in rows][:2] == ["fewest slots", "25 % of experts"]
    assert [r["slots"] for r in rows] == sorted(r["slots"] for r in rows)
    assert rows[0]["slots"] == index.n_expert_used
    assert [r["peak"] for r in rows] == sorted(r["peak"] for r in rows)
    every = next(r for r in rows if r["label"] == "every expert")
    assert every["slots"] == index.n_expert and every["hit_rate"] == 1.0 and every["read_per_token"] == 0
    assert every["decode_bound"] == "compute"
    paged = [r for r in rows if r["slots"] < index.n_expert]
    assert paged and all(0 <= r["hit_rate"] < 1 and r["read_per_token"] > 0 for r in paged)
    assert [r["decode_tps"] for r in rows] == sorted(r["decode_tps"] for r in rows)
    # the measuring run: pools of a quarter of the experts, its decode counted; it decodes past
    # its 32 tokens (in segments after paragraphs) until the readers have read enough for their own rate, which
    # the prediction then takes rather than the drive probe's bulk rate
    assert m["slots"] == -(-index.n_expert // 4) and m["decode_compute_ms"] > 0
    # (the built-in model reads 32 MiB in about 64 tokens, well within the run's 120 s)
    assert 32 <= m["n_decode"] <= MAX_DECODE, m["n_decode"]
    assert m["read_bytes"] >= MIN_READ_BYTES and report["read_gbps_used"] == m["read_gbps"] > 0, m
    # saved: a second fit measures nothing and predicts the same
    again = _fit(model, "-t", "2", "--json", cache=tmp_path / "c")
    assert again.returncode == 0 and "fit: measuring" not in again.stderr
    fixed = [r for r in rows if r["label"] != "free now"]  # (free memory moves between runs)
    assert [r for r in json.loads(again.stdout)["rows"] if r["label"] != "free now"] == fixed


def test_fit_table_names_each_budget(tmp_path):
    model = _builtin()
    out = _fit(model, "--memory", "82MiB,200MiB", "-t", "2", cache=tmp_path / "c")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("memory") and "decode t/s" in line and "bound" in line for line in lines)
    assert any(line.startswith("82.00 MiB") for line in lines) and any(line.startswith("200.00 MiB") for line in lines)
    assert "compute" in out.stdout and "O_DIRECT" in out.stdout


def test_fit_refuses_a_budget_below_the_minimum_before_running(tmp_path):
    model = _builtin()
    index = load_index(model)
    minimum = estimate(index, plan_slots(index, index.n_expert_used), **dict(ESTIMATE_KWARGS, n_ctx=256)).host
    out = _fit(model, "--memory", "10MiB", cache=tmp_path / "c")
    assert out.returncode == 1
    assert "below the least this model runs in" in out.stderr and "--memory" in out.stderr
    assert "fit: measuring" not in out.stderr and not (tmp_path / "c").exists()
    assert minimum > 10 << 20 and f"--memory {-(-minimum // (1 << 20))}MiB" in out.stderr


def test_fit_replay_matches_the_engines_hit_rate(tmp_path):
    """The prediction's hit rate at the measuring run's own slot count is the engine's, counted live."""
    model = _builtin()
    index = load_index(model)
    m = measure(model, n_threads=2, probe_seconds=0)
    assert m.decode_hit_rate is not None and m.drive is None
    trace = load_trace(m.trace_path)
    predicted = replay(trace, sizes=[m.slots], policies=["lfu-decay"])["results"][0]["hit_rate"]
    assert abs(predicted - m.decode_hit_rate) <= 0.05, (predicted, m.decode_hit_rate)
    params = dict(ESTIMATE_KWARGS, n_ctx=256)
    budget = estimate(index, plan_slots(index, m.slots), **params).host
    (row,) = predict(m, index, [(budget, "as measured")], params)
    assert row["slots"] == m.slots and row["hit_rate"] == predicted
    # at the run's own slot count the prediction is the measured run: compute + its waits
    assert row["decode_tps"] > 0 and row["decode_bound"] in ("drive", "compute")
