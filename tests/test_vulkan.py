"""Slot pools in Vulkan device memory, on Mesa's lavapipe (no GPU needed).

Runs when EMPANEL_VULKAN_LIB_DIR names the lib folder of a Vulkan build of empanel-gguf (.ci/run
makes one when the Vulkan packages can be installed); each check runs in a subprocess that loads
that build with GGML_VK_VISIBLE_DEVICES=0 (ggml-vulkan skips CPU devices otherwise).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VULKAN_LIB_DIR = os.environ.get("EMPANEL_VULKAN_LIB_DIR", "")

pytestmark = pytest.mark.skipif(
    not (VULKAN_LIB_DIR and (Path(VULKAN_LIB_DIR) / "libggml-vulkan.so").exists()),
    reason="no Vulkan build: set EMPANEL_VULKAN_LIB_DIR to a Vulkan build's lib folder (see .ci/run)",
)


def vulkan_env():
    env = dict(os.environ)
    env.update(EMPANEL_GGUF_LIB_DIR=VULKAN_LIB_DIR, GGML_VK_VISIBLE_DEVICES="0",
               PYTHONPATH=str(REPO))
    env.pop("LLAMA_CPP_LIB_PATH", None)
    return env


def test_vulkan_pools_bit_identical_to_vulkan_resident(tmp_path):
    out = tmp_path / "vulkan.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--fixtures",
         "qwen3moe-f16,qwen3moe-q4_0,qwen3moe-q4_k,deepseek2,gpt-oss", "-n", "8", "--json", str(out)],
        env=vulkan_env(), cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert out.exists(), proc.stderr[-3000:]
    rows = json.loads(out.read_text())["exactness"]
    assert len(rows) == 15
    for row in rows:
        assert row["bit_identical"], row
        # another backend, other kernels: close to the CPU results, not equal
        assert row["max_diff_vs_cpu"] < 1.0, row
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_mixed_placement_some_layers_on_device(tmp_path):
    """Half the layers offloaded: their pools in Vulkan memory, the others' in CPU memory."""
    code = textwrap.dedent("""
        import numpy as np, sys
        from empanel_gguf import Llama, fixtures
        path = fixtures.write_fixture("qwen3moe-q8_0", sys.argv[1])
        def run(moe_slots, n_ubatch):
            llm = Llama(str(path), n_ctx=128, n_ubatch=n_ubatch, n_gpu_layers=2, logits_all=True,
                        verbose=True, moe_slots=moe_slots)
            llm.eval(llm.tokenize(b"mixed placement of the pools"))
            logits = np.array(llm.scores[: llm.n_tokens], copy=True)
            ub = llm.context_params.n_ubatch
            llm.close()
            return logits, ub
        got, ub = run(4, 512)
        ref, _ = run(None, ub)
        print("IDENTICAL" if np.array_equal(got, ref) else "DIFFERENT", np.abs(got - ref).max())
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=vulkan_env(),
                          capture_output=True, text=True, timeout=600)
    assert "IDENTICAL" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    # both kinds of pool were made
    assert "Vulkan0 slot pools size" in proc.stderr
    assert "Vulkan_Host slot pools size" in proc.stderr  # CPU layers: host memory, as stock picks
