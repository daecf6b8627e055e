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


def writer():
    """The test-llama-archs binary of this checkout's build, or None."""
    given = os.environ.get("EMPANEL_ARCHS_BIN")
    if given:
        return Path(given)
    found = sorted((REPO / "build").glob("*/bin/test-llama-archs"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    binary = writer()
    if binary is None or not binary.exists():
        message = ("llama.cpp's test-llama-archs is not built (it is built with the programs: "
                   "CMAKE_ARGS=\"-DLLAMA_BUILD=OFF -DEMPANEL_PROGRAMS=ON\" pip install .)")
        if os.environ.get("EMPANEL_REQUIRE_PROGRAMS"):
            pytest.fail(message)
        pytest.skip(message)
    out = tmp_path_factory.mktemp("arch-models")
    env = dict(os.environ, EMPANEL_ARCHS_N_EXPERT=str(N_EXPERT))
    proc = subprocess.run([str(binary), "-o", str(out), "-s", str(SEED)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(out.glob("*-moe.gguf"))
    assert len(files) >= 50, f"only {len(files)} MoE models written: {proc.stderr[-2000:]}"
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
