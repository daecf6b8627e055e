"""Every MoE architecture of the pinned llama.cpp, on slot pools, bit-identical to stock.

llama.cpp's own random-model writer (tests/test-llama-archs.cpp, built with the programs:
EMPANEL_PROGRAMS=ON; patch 0009 gives it EMPANEL_ARCHS_N_EXPERT) writes one tiny model per
architecture and configuration, with 8 routed experts of which 2 are used. Each MoE file is
checked in its own process (scripts/arch_check.py): stock llama-cpp-python at its defaults
against slot pools at top-k and at half the experts, a prompt of 80 token ids (several waves)
and 8 greedy tokens: logits bit-identical, misses > 0. A crash names its architecture and the
others still run. Files without routed experts and models stock itself cannot evaluate are
excluded with their reason, asserted below (EXCLUDED). docs/architectures.md lists the result.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import require_archs_writer

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
        assert r["n_expert"] == N_EXPERT and len(r["runs"]) == 2, r
        assert all(run["identical"] and run["misses"] > 0 for run in r["runs"]), r
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
        assert len(r["runs"]) == 2 and all(run["identical"] and run["misses"] > 0 for run in r["runs"]), r
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
