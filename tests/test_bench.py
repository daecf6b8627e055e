"""empanel-gguf bench (empanel_gguf/lab/bench/, also scripts/bench.py): the synthetic Q4_K writer, and a smoke run of the benchmark on a tiny model.

The smoke run skips every root-only step (no cgroup cap, no cache drop) and takes a few seconds:
it checks the plumbing (children, JSON, rows), not speed.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = ["--shape", "synthetic", "--layers", "2", "--experts", "16", "--top-k", "4", "--embd", "256",
        "--expert-ff", "256", "--heads", "4", "--heads-kv", "2", "--head-dim", "64"]


@pytest.fixture(scope="module")
def bench():
    from empanel_gguf.lab import bench as module

    return module


@pytest.fixture(scope="module")
def tiny_model(bench, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    assert bench.main(["--write-model", str(path), "--write-only"] + TINY) == 0
    return path


def test_help(bench):
    text = "".join(bench.setup_arg_parser().format_help().split())  # argparse wraps at hyphens
    assert "--write-model" in text and "empanel-100%@none" in text and "[/plain]" in text


def test_q4_k_blocks_decode_finite(bench):
    fan_in = 512
    rng = np.random.default_rng(0)
    rows = bench.q4_k_blocks(rng, n_rows=64, ne0=fan_in, fan_in=fan_in)
    assert rows.dtype == np.uint8 and rows.shape == (64, fan_in // 256 * 144)
    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q4_K)
    assert values.shape == (64, fan_in)
    assert np.isfinite(values).all()
    # std ~ 1/sqrt(fan_in) (so activations keep their scale), mean ~ 0
    assert values.std() == pytest.approx(1 / math.sqrt(fan_in), rel=0.15)
    assert abs(values.mean()) < 0.1 / math.sqrt(fan_in)


def test_written_model(bench, tiny_model):
    reader = gguf.GGUFReader(tiny_model)
    by_name = {t.name: t for t in reader.tensors}
    for name, t in by_name.items():
        if name.endswith("norm.weight") or "gate_inp" in name:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.Q4_K, name
    exps = by_name["blk.1.ffn_down_exps.weight"]
    assert list(exps.shape) == [256, 256, 16]
    assert np.isfinite(gguf.quants.dequantize(exps.data, exps.tensor_type)).all()
    assert reader.get_field(bench.FINGERPRINT_KEY).contents() == bench.shape_fingerprint(
        bench.ModelShape(n_layer=2, n_expert=16, n_expert_used=4, n_embd=256, n_ff_exp=256,
                         n_head=4, n_head_kv=2, head_dim=64))

    # written again with the same shape: reused, not rewritten
    mtime = os.stat(tiny_model).st_mtime_ns
    assert bench.main(["--write-model", str(tiny_model), "--write-only"] + TINY) == 0
    assert os.stat(tiny_model).st_mtime_ns == mtime


def test_smoke_run(bench, tiny_model, tmp_path):
    out = tmp_path / "bench.json"
    argv = ["-m", str(tiny_model), "--configs", "stock,empanel-min,empanel-min/lfu-decay", "-r", "1", "-p", "16", "-n", "8",
            "-t", "1", "--no-cap", "--no-cgroup", "--no-drop-caches", "--probe-s", "0.2",
            "--timeout", "120", "--json", str(out), "--log-dir", str(tmp_path / "logs")]
    assert bench.main(argv + ["--warmup-tokens", "24"]) == 0
    doc = json.loads(out.read_text())

    rows = {(r["config"], r["cap"]): r for r in doc["rows"]}
    assert set(rows) == {("stock", "none"), ("empanel-min", "none"), ("empanel-min/lfu-decay", "none")}
    assert rows[("empanel-min/lfu-decay", "none")]["moe_policy"] == "lfu-decay"
    for s in doc["samples"]:  # a warm-up on other text ran before the measured run
        assert s["warmup"]["pp"]["n"] == 24 and s["warmup"]["tg"]["n"] == 8
    assert doc["samples"][1]["warmup"]["moe"]["misses"] > 0
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["finite"]
        assert row["pp_tps"] > 0 and row["tg_tps"] > 0
        assert row["n_pp"] == 16 and row["n_tg"] == 8
        assert row["peak_rss"] > 10 * 2**20

    slots = rows[("empanel-min", "none")]
    # 4 slots, top-4: no cap, the prompt runs in waves (2 experts each: half the pool)
    assert slots["n_ubatch"] == rows[("stock", "none")]["n_ubatch"]
    assert slots["pp_waves"] > 1
    assert slots["slots_per_layer"] == 4
    assert 0.0 <= slots["tg_hit"] <= 1.0
    expert_bytes = doc["model"]["expert_bytes"][0]
    assert 0 < slots["tg_read_per_tok"] <= 2 * 4 * expert_bytes  # at most top-k misses per layer
    assert slots["ceiling_tps"] > 0 and slots["pct_ceiling"] > 0
    # forced trace: every arm decodes the same tokens
    assert slots["argmax_agree"].endswith("/8")

    assert len(doc["samples"]) == 3
    assert doc["samples"][2]["log"].endswith("empanel-min-lfu-decay-none-r1.log")
    assert all(len(s["tg"]["token_s"]) == 8 for s in doc["samples"])
    assert "| model" in doc["tables"]["main"] and "tg8" in doc["tables"]["main"]


def test_smoke_run_with_a_neighbour(bench, tiny_model, tmp_path):
    """--neighbour: another process takes memory before decoded token 2 and leaves before token 6;
    the rows split the decode there and say what the pools did (no cgroup here: plumbing only)."""
    out = tmp_path / "bench.json"
    argv = ["-m", str(tiny_model), "--configs", "stock,empanel-min/elastic=on", "-r", "1", "-p", "16", "-n", "8",
            "-t", "1", "--no-cap", "--no-cgroup", "--no-drop-caches", "--probe-s", "0", "--no-warmup",
            "--timeout", "120", "--json", str(out), "--log-dir", str(tmp_path / "logs"),
            "--neighbour", "16MiB", "--neighbour-at", "2", "--neighbour-leave", "6"]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    for sample in doc["samples"]:
        nb = sample["tg"]["neighbour"]
        assert nb["rc"] == 0 and nb["held_s"] is not None and nb["at"] == 2 and nb["leave_at"] == 6
    rows = {r["config"]: r for r in doc["rows"]}
    for row in rows.values():
        assert row["tg_before_tps"] > 0 and row["tg_with_tps"] > 0 and row["tg_after_tps"] > 0
    assert doc["samples"][1]["tg"]["budget"]["elastic"] is True
    assert "neighbour: 16.00 MiB taken before decoded token 2, freed before token 6" in doc["tables"]["neighbour"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_smoke_run_on_tmpfs_with_a_neighbour_at_load(bench, tiny_model, tmp_path):
    """--tmpfs: the runs read a copy of the model in /dev/shm, removed at the end; --neighbour-at
    load: the neighbour holds its memory before the model loads and leaves before token 4."""
    out = tmp_path / "bench.json"
    before = set(os.listdir("/dev/shm"))
    argv = ["-m", str(tiny_model), "--configs", "empanel-min/elastic=on", "-r", "1", "-p", "16", "-n", "8", "-t", "1",
            "--no-cap", "--no-cgroup", "--no-drop-caches", "--probe-s", "0", "--no-warmup", "--timeout", "120",
            "--json", str(out), "--log-dir", str(tmp_path / "logs"), "--tmpfs",
            "--neighbour", "16MiB", "--neighbour-at", "load", "--neighbour-leave", "4"]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["model"]["path"].startswith("/dev/shm/") and set(os.listdir("/dev/shm")) <= before
    nb = doc["samples"][0]["tg"]["neighbour"]
    assert nb["at_load"] and nb["rc"] == 0 and nb["held_s"] is not None
    assert doc["rows"][0]["status"] == "ok" and doc["rows"][0]["tg_after_tps"] > 0
    assert "taken before the load, freed before token 4" in doc["tables"]["neighbour"]


def test_smoke_run_of_a_cold_long_prompt(bench, tiny_model, tmp_path):
    """--no-warmup, a prompt longer than 512 tokens: each run keeps its own micro-batch (stock
    512 without flash attention, the pools the plan's: one call), the ceiling runs stock
    --no-repack at the pools' micro-batch after a warm-up, and the prompt table compares them
    (time to first token, bytes read per call)."""
    out = tmp_path / "bench.json"
    argv = ["-m", str(tiny_model), "--configs", "stock-mmap,empanel-min,ceiling", "-r", "1", "-p", "600", "-n", "2",
            "-t", "1", "--no-cap", "--no-cgroup", "--no-drop-caches", "--probe-s", "0", "--no-warmup",
            "--timeout", "120", "--json", str(out), "--log-dir", str(tmp_path / "logs")]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    rows = {r["config"]: r for r in doc["rows"]}
    assert rows["stock-mmap"]["n_ubatch"] == 512 and not rows["stock-mmap"]["flash_attn"]
    assert rows["empanel-min"]["n_ubatch"] == rows["ceiling"]["n_ubatch"] == rows["empanel-min"]["n_batch"] > 600
    assert rows["empanel-min"]["flash_attn"] and rows["ceiling"]["flash_attn"]
    assert rows["empanel-min"]["pp_calls"] == 1 and rows["stock-mmap"]["pp_calls"] == 2
    assert rows["ceiling"].get("pp_read_bytes") is None  # stock: nothing paged
    ceiling = next(s for s in doc["samples"] if s["config"] == "ceiling")
    assert ceiling["warmup"] is not None  # the ceiling warms up even under --no-warmup
    table = doc["tables"]["prompt"]
    assert "TTFT s" in table and "read per call / experts" in table and "| ceiling" in table


def test_command_and_script_reach_the_bench(tmp_path):
    for argv in ([sys.executable, "-m", "empanel_gguf", "bench", "--help"],
                 [sys.executable, str(REPO / "scripts" / "bench.py"), "--help"]):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "usage: empanel-gguf bench" in done.stdout and "--write-model" in done.stdout


def test_config_options_reach_llama():
    from empanel_gguf.lab.bench.configs import parse_config

    (cfg,) = parse_config("empanel-25%/lfu-decay/prefetch=2/guess=off@cap", top_k=8)
    assert cfg.moe_slots == "25%" and cfg.moe_policy == "lfu-decay" and cfg.cap == "cap"
    assert cfg.moe_opts == {"moe_prefetch": 2, "moe_guess": False} and not cfg.plain
    (cfg,) = parse_config("empanel-25%/plain@none", top_k=8)
    assert cfg.plain and cfg.moe_opts is None and not cfg.bounce
    (cfg,) = parse_config("empanel-25%/plain/bounce@none", top_k=8)
    assert cfg.plain and cfg.bounce and not cfg.sync
    (cfg,) = parse_config("empanel-25%/plain/sync@cap", top_k=8)
    assert cfg.plain and cfg.sync and not cfg.bounce
    (cfg,) = parse_config("empanel-25%/plain/prefetch=1/EMPANEL_READ_AHEAD_KEEP=1@cap", top_k=8)
    assert cfg.env == {"EMPANEL_READ_AHEAD_KEEP": "1"} and cfg.moe_opts == {"moe_prefetch": 1}
    (cfg,) = parse_config("stock/plain@none", top_k=8)  # stock resident as llama.cpp --no-repack
    assert cfg.kind == "stock" and cfg.plain and cfg.moe_slots is None and cfg.key == "stock/plain@none"
    (cfg,) = parse_config("ceiling@none", top_k=8)  # the same at the pools' micro-batch
    assert cfg.kind == "stock" and cfg.plain and cfg.pools_batch
    with pytest.raises(SystemExit, match="neither a policy"):
        parse_config("empanel-25%/fifo", top_k=8)
