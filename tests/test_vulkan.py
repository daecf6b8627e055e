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
from conftest import require_vulkan

REPO = Path(__file__).resolve().parent.parent
VULKAN_LIB_DIR = os.environ.get("EMPANEL_VULKAN_LIB_DIR", "")


@pytest.fixture(autouse=True)
def _vulkan_build():
    require_vulkan()


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


def test_waves_bit_identical_to_vulkan_stock_defaults(tmp_path):
    """Prompts that route to more experts than the pools hold run in waves on Vulkan too, as on
    the CPU: each wave's MUL_MAT_ID skips the other waves' pairs (slot id -1; patch 0011) and
    writes into the previous wave's output. Every llama-cpp-python default kept (n_batch =
    n_ubatch = 512); prompts of 5 (the matrix-vector kernels), 9, 100 and 700 tokens (more than
    n_batch) and 8 greedy tokens give the logits of the same build without slots. Masked waves
    (EMPANEL_WAVE_MASK=1: every pair multiplied, a 0/1 mask keeps each wave's) too, on one fixture."""
    code = textwrap.dedent("""
        import json, os, sys
        import numpy as np
        from empanel_gguf import Llama
        from empanel_gguf.models import fixtures
        from empanel_gguf.lab.exactness import greedy_logits
        TEXT = b" ".join(b"%d: the %s fox and the lazy dog, seen %d times." % (i, b"quick" if i % 3 else b"slow", i * 7)
                         for i in range(200))
        def run(path, moe_slots, n_prompt, prefetch=0):
            llm = Llama(str(path), n_ctx=1024, n_gpu_layers=99, logits_all=True, verbose=False,
                        moe_slots=moe_slots, moe_prefetch=prefetch)
            try:
                logits, tokens = greedy_logits(llm, llm.tokenize(TEXT)[:n_prompt], 8)
                return logits, tokens, llm.moe_stats(), llm.context_params.n_ubatch
            finally:
                llm.close()
        rows = []
        for name in sys.argv[2].split(","):
            spec = fixtures.FIXTURES[name]
            path = fixtures.write_fixture(name, sys.argv[1])
            for n_prompt in (5, 9, 100, 700):
                ref, ref_tokens, _, ref_ubatch = run(path, None, n_prompt)
                modes = [(spec.n_expert_used, "0"), ("25%", "0")]
                if name == "qwen3moe-q4_k" and n_prompt in (5, 100):
                    modes.append(("25%", "1"))
                for slots, mask in modes:
                    os.environ["EMPANEL_WAVE_MASK"] = mask
                    # 25 %: the gate-ahead guess reads ahead into the device pools as well
                    got, tokens, stats, ubatch = run(path, slots, n_prompt, 1 if slots == "25%" else 0)
                    total = stats["total"]
                    rows.append(dict(name=name, slots=str(slots), n_prompt=n_prompt, ubatch=ubatch, mask=mask,
                                     ref_ubatch=ref_ubatch, same_tokens=tokens == ref_tokens,
                                     identical=bool(np.array_equal(got, ref)),
                                     max_diff=float(np.abs(got - ref).max()),
                                     n_waves=total["n_waves"], n_remaps=total["n_remaps"],
                                     masked_pools=total["masked_pools"], prefetched=total["prefetched"]))
        print("ROWS", json.dumps(rows))
    """)
    names = "qwen3moe-q4_k,gpt-oss,deepseek2"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), names], env=vulkan_env(),
                          capture_output=True, text=True, timeout=1500)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ROWS ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(lines[0][5:])
    assert len(rows) == 3 * 4 * 2 + 2
    for row in rows:
        assert row["ubatch"] == row["ref_ubatch"] == 512, row  # no cap
        assert row["identical"] and row["same_tokens"], row
        if row["mask"] == "1":
            assert row["masked_pools"] > 0, row
        else:
            assert row["masked_pools"] == 0, row  # Vulkan device pools skip pairs
        if row["n_prompt"] in (5, 100, 700):
            assert row["n_waves"] > row["n_remaps"], row  # the prompt ran in waves
    assert any(row["prefetched"] > 0 for row in rows)  # read-ahead into device pools ran


def test_device_syncs_counted_and_none_when_pinned(tmp_path):
    """Each remap and each gate-ahead guess of a layer whose pools are in device memory waits
    for the device (its expert ids to the host): moe_stats() counts them per token. qwen3moe-f16
    has 3 MoE layers: a decoded token at 25 % slots waits 3 times for the remaps and twice for the
    guesses (each layer guesses the next), 3 times without guesses, and never at 100 % slots
    (pinned: stock's graph)."""
    code = textwrap.dedent("""
        import json, sys
        from empanel_gguf import Llama
        from empanel_gguf.models import fixtures
        path = fixtures.write_fixture("qwen3moe-f16", sys.argv[1])
        out = {}
        for name, kwargs in (("25%", dict(moe_slots="25%")), ("25%-noguess", dict(moe_slots="25%", moe_guess=False)),
                             ("100%", dict(moe_slots="100%"))):
            llm = Llama(str(path), n_ctx=256, n_gpu_layers=99, verbose=False, **kwargs)
            llm.eval(llm.tokenize(b"The quick brown fox jumps over the lazy dog"))
            llm._experts.reset_stats()
            for _ in range(8):
                llm.eval([llm.tokenize(b" a")[-1]])
            t = llm.moe_stats()["total"]
            out[name] = dict(per_token=t["device_syncs_per_token"], tokens=t["tokens"], pinned=llm.moe_load.pinned)
            llm.close()
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=vulkan_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["25%"] == dict(per_token=5.0, tokens=8, pinned=False), out
    assert out["25%-noguess"]["per_token"] == 3.0, out
    assert out["100%"]["per_token"] == 0.0 and out["100%"]["pinned"], out


def test_mixed_placement_some_layers_on_device(tmp_path):
    """Half the layers offloaded: their pools in Vulkan memory, the others' in CPU memory."""
    code = textwrap.dedent("""
        import numpy as np, sys
        from empanel_gguf import Llama
        from empanel_gguf.models import fixtures
        path = fixtures.write_fixture("qwen3moe-q8_0", sys.argv[1])
        TEXT = b" ".join(b"%d: mixed placement of the pools" % i for i in range(40))
        def run(moe_slots, n_prompt):
            llm = Llama(str(path), n_ctx=512, n_gpu_layers=2, logits_all=True, verbose=True,
                        moe_slots=moe_slots)
            llm.eval(llm.tokenize(TEXT)[:n_prompt])
            logits = np.array(llm.scores[: llm.n_tokens], copy=True)
            llm.close()
            return logits
        # 6 tokens: every MUL_MAT_ID where its weights are; 200: op offload takes the CPU layers'
        # (host pools') MUL_MAT_IDs to the device, a copy of the pool per wave
        for n_prompt in (6, 200):
            got, ref = run(4, n_prompt), run(None, n_prompt)
            print("IDENTICAL" if np.array_equal(got, ref) else "DIFFERENT", n_prompt, np.abs(got - ref).max())
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=vulkan_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.stdout.count("IDENTICAL") == 2, proc.stdout + proc.stderr[-3000:]
    # both kinds of pool were made
    assert "Vulkan0 slot pools size" in proc.stderr
    assert "Vulkan_Host slot pools size" in proc.stderr  # CPU layers: host memory, as stock picks


def test_read_failure_on_device_pools_raises_with_no_logits(tmp_path):
    """A failed read while the pools live in device memory raises MoeReadError: no logits of the
    micro-batch, the KV cache rolled back, in a prompt's waves and in decode (the abort callback
    that stops a graph is honoured by the CPU backend only; the sidecar's own check after the
    decode covers Vulkan)."""
    code = textwrap.dedent("""
        import os, sys
        import numpy as np
        from empanel_gguf import Llama, MoeReadError
        from empanel_gguf.models import fixtures
        path = fixtures.write_fixture("qwen3moe-q4_k", sys.argv[1])
        TEXT = b" ".join(b"%d: a device pool that cannot read" % i for i in range(60))
        def load(fault_after=None):
            if fault_after is not None:
                os.environ["EMPANEL_FAULT_READ_AFTER"] = str(fault_after)  # read at pool init
            try:
                return Llama(str(path), n_ctx=512, n_gpu_layers=99, logits_all=True, verbose=False,
                             moe_slots=4, moe_preload=False)
            finally:
                os.environ.pop("EMPANEL_FAULT_READ_AFTER", None)
        ref = load()
        tokens = ref.tokenize(TEXT)[:300]
        ref.eval(tokens)
        want = np.array(ref.scores[: ref.n_tokens], copy=True)
        ref.close()
        ref = load()
        ref.eval(tokens[:200])
        prompt_requests = ref.moe_stats()["total"]["n_reads"]
        ref.close()
        # the prompt's first read; one in a later wave; the first read after a 200-token prompt
        for fault_after, n_first in ((1, 0), (prompt_requests // 2, 0), (prompt_requests + 1, 200)):
            llm = load(fault_after)
            try:
                if n_first:
                    llm.eval(tokens[:n_first])
                try:
                    llm.eval(tokens[n_first:])
                    print("NO ERROR", fault_after)
                except MoeReadError as e:
                    ok = llm.n_tokens == n_first and "EMPANEL_FAULT_READ_AFTER" in str(e)
                    print("RAISED" if ok else "BAD", fault_after, llm.n_tokens, str(e)[:160])
            finally:
                llm.close()
        llm = load()  # a healthy load afterwards: the reference logits
        llm.eval(tokens)
        print("HEALTHY" if np.array_equal(np.array(llm.scores[: llm.n_tokens]), want) else "DIFFERENT")
        llm.close()
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=vulkan_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("RAISED") == 3 and "HEALTHY" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_host_tier_serves_device_misses_bit_identical(tmp_path):
    """moe_host_cache on Vulkan device pools: experts the pools read stay in host memory, and a
    later miss is written to its slot from there, not read again. A prompt that runs in waves
    and 8 greedy tokens give the logits of the same build without slots; with a tier that holds
    every expert the second pass of the prompt reads nothing from the drive; with a tier of half the
    experts some misses come from it, the others from the drive."""
    code = textwrap.dedent("""
        import json, os, sys
        import numpy as np
        from empanel_gguf import Llama
        from empanel_gguf.models import fixtures
        from empanel_gguf.lab.exactness import greedy_logits
        TEXT = b" ".join(b"%d: the %s fox, the tier, the lazy dog." % (i, b"quick" if i % 3 else b"slow")
                         for i in range(120))
        out = {}
        for name in ("qwen3moe-q4_k", "deepseek2"):
            path = fixtures.write_fixture(name, sys.argv[1])
            def run(**kwargs):
                llm = Llama(str(path), n_ctx=1024, n_gpu_layers=99, logits_all=True, verbose=False, **kwargs)
                try:
                    tokens = llm.tokenize(TEXT)[:300]
                    logits, got = greedy_logits(llm, tokens, 8)
                    first = llm.moe_stats()["total"] if kwargs else None
                    if kwargs:
                        llm._experts.reset_stats()
                        llm.reset()
                        again, _ = greedy_logits(llm, tokens, 8)
                        assert np.array_equal(again, logits)
                    return logits, got, first, llm.moe_stats()["total"] if kwargs else None
                finally:
                    llm.close()
            ref, ref_tokens, _, _ = run()
            for tier in ("256MiB", "1MiB"):
                got, tokens, first, second = run(moe_slots="25%", moe_host_cache=tier)
                out[f"{name} {tier}"] = dict(
                    identical=bool(np.array_equal(got, ref)) and tokens == ref_tokens,
                    first_hits=first["host_hits"], first_read=first["bytes_read"],
                    second_hits=second["host_hits"], second_read=second["bytes_read"],
                    second_misses=second["misses"], host_bytes=second["host_bytes"])
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=vulkan_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key, row in out.items():
        assert row["identical"], (key, row)
        assert row["second_misses"] > 0 and row["second_hits"] > 0 and row["host_bytes"] > 0, (key, row)
        if key.endswith("256MiB"):  # every expert fits: the second pass reads nothing
            assert row["second_read"] == 0, (key, row)
    # 1 MiB holds 8 of qwen3moe-q4_k's 16 experts: some misses come from the tier, others from the drive
    assert out["qwen3moe-q4_k 1MiB"]["second_read"] > 0, out


def test_pools_in_a_pinned_host_buffer_keep_their_memory_and_say_so(tmp_path):
    """n_gpu_layers=0 on a GPU build: llama.cpp puts the CPU layers' weights, pools too, in the GPU
    backend's pinned host buffer, whose pages madvise does not give back. Such pools are fixed and
    say why (moe_elastic too): a budget set lower is refused, where before the evicted experts were
    counted as given back while the memory stayed charged (63-1)."""
    code = textwrap.dedent("""
        import json, sys
        from empanel_gguf import Llama
        from empanel_gguf.models import fixtures
        path = fixtures.write_fixture("qwen3moe-f16", sys.argv[1])
        llm = Llama(str(path), n_ctx=128, n_gpu_layers=0, verbose=False, moe_slots="50%", moe_elastic=True)
        llm.eval(llm.tokenize(b"The quick brown fox jumps over the lazy dog"))
        budget = llm.moe_stats()["budget"]
        try:
            llm.moe_set_budget(budget["floor_bytes"])
            refused = None
        except ValueError as e:
            refused = str(e)
        print(json.dumps({"budget": budget, "refused": refused}))
        llm.close()
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=vulkan_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    budget = out["budget"]
    assert budget["fixed"] and not budget["elastic"] and budget["given_back_bytes"] == 0, out
    assert out["refused"] is not None and "pinned host buffer" in out["refused"], out
    assert "pinned host buffer" in proc.stderr, proc.stderr[-3000:]
