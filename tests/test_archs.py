"""Every MoE architecture of the pinned llama.cpp, on slot pools, bit-identical to stock.

llama.cpp's own random-model writer (tests/test-llama-archs.cpp, built with the programs:
EMPANEL_PROGRAMS=ON; patch 0009 gives it EMPANEL_ARCHS_N_EXPERT) writes one tiny model per
architecture and configuration, with 8 routed experts of which 2 are used. Each MoE file is
checked in its own process (scripts/arch_check.py): stock llama-cpp-python at its defaults
against slot pools at top-k and at half the experts, a prompt of 80 token ids (several waves)
and 8 greedy tokens, and top-k again with the prompt in one call of 5 micro-batches (n_ubatch 16,
stock the same): logits bit-identical, misses > 0. A crash names its architecture and the
others still run. Files without routed experts and models stock itself cannot evaluate are
excluded with their reason, asserted below (EXCLUDED). docs/architectures.md lists the result.
The MTP architectures are written again with an MTP block: loaded or skipped as llama.cpp does,
and drafting with it in llama-server (--spec-type draft-mtp) over pools, against stock's drafting.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import loadgen
import numpy as np
import pytest
from conftest import require_archs_writer, require_programs

REPO = Path(__file__).resolve().parent.parent
N_EXPERT = 8
SEED = 1

# architecture -> why it is excluded, as arch_check.py reports it (a substring of the reason)
EXCLUDED = {
    "ernie4_5": "no routed expert in the file",
    "paddleocr": "no routed expert in the file",
    "refact": "its graph never routes experts",
    "llada-moe": "stock fails the same way: AssertionError: Memory is not initialized",  # diffusion
    "rnd1": "stock fails the same way: AssertionError: Memory is not initialized",       # diffusion
}

# a few architectures of different families, also with read-ahead and with masked waves:
# MLA + shared experts + a leading dense block, hybrid recurrent, sliding window + expert biases +
# attention sinks, selection bias (exp_probs_b), hybrid short convolutions
VARIANT_ARCHS = ("deepseek2", "qwen3next", "gpt-oss", "glm4moe", "lfm2moe")

# every architecture of index.MTP_ARCHS (llama.cpp loads their MTP blocks with load_mtp), written
# again with one MTP block appended (EMPANEL_ARCHS_NEXTN=1, patch 0009), but these, which the
# writer has no MoE model of (nor has the sweep above)
MTP_NOT_WRITTEN = {
    "deepseek4": "its loader counts an MTP block only if blk.N.nextn.eh_proj.weight is in the file, and the "
                 "writer builds the model from metadata alone: it writes a trunk of one block more",
    "nemotron_h_moe": "the writer has no MoE fixture of it (test-llama-archs.cpp's moe_implemented)",
    "step35": "llama.cpp's model saver does not support it (llama_model_saver_supports_arch)",
}
# MTP drafting loads the blocks: their pools are made and bound (llama.cpp's main graph never
# routes them; drafting itself is not checked here)
MTP_LOADED_ARCHS = ("glm4moe", "deepseek2", "qwen3next")


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    binary = require_archs_writer()
    out = tmp_path_factory.mktemp("arch-models")
    env = dict(os.environ, EMPANEL_ARCHS_N_EXPERT=str(N_EXPERT))
    proc = subprocess.run([str(binary), "-o", str(out), "-s", str(SEED)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(out.glob("*-moe.gguf"))
    assert len(files) >= 50, f"only {len(files)} MoE models written: {proc.stderr[-2000:]}"
    return files


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    """The MTP architectures' files with one MTP block, as GLM-4.x files carry it: the writer
    appends a block (block_count + 1, nextn_predict_layers = 1) with the nextn tensors. It writes
    every tensor the loader makes with load_mtp, the per-tensor `.scale`/`.input_scale` of the
    MTP block included, which real files do not carry and a stock load without load_mtp would
    count as missing: they are dropped from the copy tested."""
    from empanel_gguf.models.gguf_writer import copy_without_tensors
    from empanel_gguf.planning.index import MTP_ARCHS, load_index

    binary = require_archs_writer()
    out = tmp_path_factory.mktemp("mtp-models")
    (out / "raw").mkdir()
    archs = sorted(MTP_ARCHS - set(MTP_NOT_WRITTEN))
    env = dict(os.environ, EMPANEL_ARCHS_N_EXPERT=str(N_EXPERT), EMPANEL_ARCHS_NEXTN="1")
    proc = subprocess.run([str(binary), "-o", str(out / "raw"), "-s", str(SEED), "-a", f"^({'|'.join(archs)})$"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = []
    for raw in sorted((out / "raw").glob("*-moe.gguf")):
        index = load_index(raw)
        assert index.n_layer_nextn == 1 and index.mtp_skipped, raw.name  # an MoE MTP block was written
        def scale_of_mtp_block(name, first=index.mtp_layers[0]):
            parts = name.split(".")
            return parts[0] == "blk" and int(parts[1]) >= first and parts[-1] in ("scale", "input_scale")

        copy_without_tensors(raw, out / raw.name, scale_of_mtp_block)
        files.append(out / raw.name)
    assert sorted(f.name.removesuffix("-moe.gguf") for f in files) == archs, proc.stderr[-2000:]
    return files


def check(path, variant="plain"):
    """arch_check.py on one file in its own process: its result, or a failure naming it."""
    env = {k: v for k, v in os.environ.items() if k not in ("EMPANEL_WAVE_MASK", "LLAMA_CPP_LIB_PATH")}
    if variant == "mask":
        env["EMPANEL_WAVE_MASK"] = "1"
    try:
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "arch_check.py"), str(path), "--variant", variant],
                              env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"file": path.name, "arch": path.stem, "variant": variant, "status": "fail", "reason": "timed out"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        return {"file": path.name, "arch": path.name.removesuffix("-moe.gguf"), "variant": variant,
                "status": "fail", "reason": f"the check died ({how}): {proc.stderr[-800:]}"}
    return json.loads(lines[-1])


def sweep(files, variant="plain"):
    with ThreadPoolExecutor(max_workers=2) as pool:  # CI has 2 cores; each check is one process
        return list(pool.map(lambda f: check(f, variant), files))


def test_every_moe_architecture_is_bit_identical_on_slot_pools(arch_models):
    results = sweep(arch_models)
    report = os.environ.get("EMPANEL_ARCHS_REPORT")
    if report:
        Path(report).write_text(json.dumps(results, indent=1))
    failed = [f"{r['arch']} ({r['file']}): {r['reason']}" for r in results if r["status"] == "fail"]
    assert not failed, "\n".join(failed)
    excluded = {r["arch"]: r["reason"] for r in results if r["status"] == "excluded"}
    assert set(excluded) == set(EXCLUDED), excluded
    for arch, why in EXCLUDED.items():
        assert why in excluded[arch], (arch, excluded[arch])
    ok = [r for r in results if r["status"] == "ok"]
    assert len(ok) + len(excluded) == len(results)
    for r in ok:
        # top-k and half the experts; top-k again with the prompt in one call of several micro-batches
        assert r["n_expert"] == N_EXPERT and len(r["runs"]) == 3 and r["runs"][2]["n_ubatch"] == 16, r
        assert all(run["identical"] and run["misses"] > 0 for run in r["runs"]), r
        assert r["runs"][2]["remaps"] > r["runs"][0]["remaps"], r  # each micro-batch remapped on its own
    # the list users read is this test's own result
    listed = (REPO / "docs" / "architectures.md").read_text()
    for r in ok:
        assert f"| `{r['arch']}` |" in listed, f"{r['arch']} passes but docs/architectures.md does not list it"


@pytest.mark.parametrize("variant", ["prefetch", "mask"])
def test_read_ahead_and_masked_waves_on_several_families(arch_models, variant):
    files = [f for f in arch_models if f.name.removesuffix("-moe.gguf") in VARIANT_ARCHS]
    assert len(files) == len(VARIANT_ARCHS), [f.name for f in files]
    results = sweep(files, variant)
    failed = [f"{r['arch']}: {r['reason']}" for r in results if r["status"] != "ok"]
    assert not failed, "\n".join(failed)


def test_files_with_an_mtp_block_are_bit_identical_on_slot_pools(mtp_models):
    """Issue 36: llama.cpp skips an MTP block without load_mtp; so does the plan (no pool), and
    the trunk pages as in any file: stock's logits bit for bit at top-k and half, with misses."""
    results = sweep(mtp_models)
    failed = [f"{r['arch']}: {r['reason']}" for r in results if r["status"] != "ok"]
    assert not failed, "\n".join(failed)
    listed = (REPO / "docs" / "architectures.md").read_text()
    for r in results:
        assert r["mtp_layers"] and not r["mtp_loaded"], r
        assert len(r["runs"]) == 3 and all(run["identical"] and run["misses"] > 0 for run in r["runs"]), r
        assert f"| `{r['arch']}` | MTP |" in listed, f"{r['arch']} with an MTP block is not in docs/architectures.md"


def test_mtp_blocks_loaded_get_pools_and_stay_bit_identical(mtp_models):
    """With load_mtp (moe_mtp=True, as --spec-type draft-mtp) the MTP block's MoE layer gets its
    pools too, and the main graph's logits still equal stock's loaded the same way."""
    files = [f for f in mtp_models if f.name.removesuffix("-moe.gguf") in MTP_LOADED_ARCHS]
    assert len(files) == len(MTP_LOADED_ARCHS)
    for r in sweep(files, "mtp"):
        assert r["status"] == "ok", r
        assert r["mtp_loaded"] and r["mtp_layers"], r


def test_pools_planned_for_a_block_llama_cpp_skips_are_named(mtp_models):
    """A plan that pages the MTP block of a load that skips it is refused, naming the tensors
    that got no pool (not "architecture not supported")."""
    path = next(f for f in mtp_models if f.name.startswith("glm4moe"))
    code = (
        "import sys\n"
        "from empanel_gguf import Llama\n"
        "from empanel_gguf.planning.index import load_index\n"
        "from empanel_gguf.planning.plan import moe_options, plan_load\n"
        f"index = load_index({str(path)!r}, mtp=True)\n"
        "load = plan_load(index, 2, {'n_ctx': 256}, options=moe_options(moe_profile=None), guard=False)\n"
        "try:\n"
        f"    Llama({str(path)!r}, n_ctx=256, verbose=False, moe_load=load)\n"
        "except Exception as e:\n"
        "    print('ERROR', e)\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    from empanel_gguf.planning.index import load_index

    layer = load_index(path).mtp_layers[0]
    assert f"blk.{layer}.ffn_down_exps.weight" in proc.stdout, proc.stdout
    assert "got no pool" in proc.stdout and "not supported" not in proc.stdout, proc.stdout


# MTP drafting (llama-server --spec-type draft-mtp) builds its graph for these; the others of
# mtp_models fail in stock itself, so they cannot be compared
MTP_DRAFT_ARCHS = ("bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "glm-dsa", "hy_v3", "qwen35moe",
                   "qwen3next")
MTP_DRAFT_FAILS_IN_STOCK = {
    "glm4moe": "GGML_ASSERT(sections[0] > 0 ...) in rope: the writer's model has no rope sections",
    "glm5-next": "GLM5-Next NextN graph not implemented yet",
    "mimo2": "MIMO2 MTP requires fused attn_qkv",
}
# a few tokens the narrowed heads favour, so that the MTP head's drafts are sometimes accepted
HEAD_TOKENS = (10, 20, 30, 40)
MTP_PROMPT = [1, 5, 9, 17, 33, 2, 7, 40, 60, 3]
MTP_N_PREDICT = 32


def narrow_heads(src, dst):
    """A copy whose output heads (the trunk's `output.weight` and the MTP block's shared head)
    score only HEAD_TOKENS: random heads of a random model agree on almost no draft."""
    shutil.copyfile(src, dst)
    reader = gguf.GGUFReader(dst, mode="r+")
    rng = np.random.default_rng(0)
    heads = [t for t in reader.tensors if t.name == "output.weight" or t.name.endswith("nextn.shared_head_head.weight")]
    assert len(heads) >= 1 and all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in heads), [
        (t.name, t.tensor_type) for t in heads]
    for t in heads:
        w = t.data  # [n_vocab, n_embd] in numpy order, a view of the file
        scale = 20.0 * float(np.abs(w).mean())
        w[:] = 0
        for row in HEAD_TOKENS:
            w[row] = rng.standard_normal(w.shape[1]).astype(w.dtype) * scale
    reader.data.flush()
    return dst


def draft_run(path, moe_slots, log, mtp):
    """One greedy completion on `empanel-gguf llama-server`: its text, tokens, drafted and accepted
    counts, and each paged layer's misses and bytes read."""
    def by_layer(base, series):  # {layer: value} of one per-layer series (none at --moe-slots none)
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        return {int(il): float(v) for il, v in re.findall(rf'^empanel_{series}\{{[^}}]*layer="(\d+)"\}} (\S+)$',
                                                          metrics, re.M)}

    extra = ("--spec-type", "draft-mtp", "--spec-draft-n-max", "3") if mtp else ()
    with loadgen.llama_server(str(path), moe_slots, log, *extra) as (base, _):
        loaded = by_layer(base, "read_bytes_total")  # the load's preload, not the request's
        status, body = loadgen.post(base, "/completion", json.dumps(
            {"prompt": MTP_PROMPT, "n_predict": MTP_N_PREDICT, "temperature": 0, "cache_prompt": False}).encode())
        assert status == 200, body[-2000:]
        misses = by_layer(base, "expert_misses_total")
        read = {il: v - loaded.get(il, 0) for il, v in by_layer(base, "read_bytes_total").items()}
    answer = json.loads(body)
    timings = answer.get("timings", {})
    return dict(text=answer["content"], tokens=answer.get("tokens_predicted"), drafted=timings.get("draft_n", 0),
                accepted=timings.get("draft_n_accepted", 0), misses=misses, read_bytes=read)


def test_mtp_drafting_over_pools_equals_stock(mtp_models, tmp_path):
    """Issue 41: llama-server's MTP drafting (--spec-type draft-mtp) over pools of top-k slots
    gives stock's text and stock's drafted and accepted counts, the MTP block's experts paged
    (misses in its layer); without drafting the text is the same (greedy drafts change no answer).
    EMPANEL_MTP_REPORT=FILE writes each run's numbers (bytes read per token, with and without)."""
    from empanel_gguf.planning.index import load_index

    require_programs("llama-server")
    by_arch = {f.name.removesuffix("-moe.gguf"): f for f in mtp_models}
    assert set(MTP_DRAFT_ARCHS) | set(MTP_DRAFT_FAILS_IN_STOCK) == set(by_arch), sorted(by_arch)
    report, failed = [], []
    for arch in MTP_DRAFT_ARCHS:
        path = narrow_heads(by_arch[arch], tmp_path / f"{arch}-heads.gguf")
        index = load_index(path, mtp=True)
        mtp_layer = index.mtp_layers[0]
        stock = draft_run(path, "none", tmp_path / f"{arch}-stock.log", mtp=True)
        paged = draft_run(path, str(index.n_expert_used), tmp_path / f"{arch}-paged.log", mtp=True)
        plain = draft_run(path, str(index.n_expert_used), tmp_path / f"{arch}-plain.log", mtp=False)
        report.append(dict(arch=arch, mtp_layer=mtp_layer, stock=stock, paged=paged, plain=plain))
        same = (paged["text"], paged["drafted"], paged["accepted"]) == (stock["text"], stock["drafted"], stock["accepted"])
        if not same or plain["text"] != stock["text"]:
            failed.append(f"{arch}: stock {stock}, paged {paged}, without MTP {plain}")
        elif not (stock["drafted"] > 0 and paged["misses"].get(mtp_layer, 0) > 0
                   and plain["misses"].get(mtp_layer, 0) == 0):
            failed.append(f"{arch}: no drafts, or the MTP layer {mtp_layer} was not paged: {paged}")
    out = os.environ.get("EMPANEL_MTP_REPORT")
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
    assert not failed, "\n".join(failed)
    # the narrowed heads make drafts accepted on most architectures: the test would catch drafts
    # that stock accepts and the pools do not
    assert sum(r["stock"]["accepted"] > 0 for r in report) >= 4, [(r["arch"], r["stock"]["accepted"]) for r in report]
