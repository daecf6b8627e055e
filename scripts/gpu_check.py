"""Slot pools on a GPU backend: exactness and speed, in one short run.

    python scripts/gpu_check.py                 # fixtures, all layers offloaded (-ngl 99)
    python scripts/gpu_check.py --speed MODEL   # also time decode: 100 % slots vs resident, 25 %
    python scripts/gpu_check.py --fixtures '' --waves MODEL   # prompt in waves: skipping vs masked

Run it on a build with the backend enabled (CMAKE_ARGS="-DLLAMA_BUILD=OFF -DGGML_CUDA=on" pip
install ., or -DGGML_VULKAN=on; on lavapipe set GGML_VK_VISIBLE_DEVICES=0). For each fixture and
slot count (minimum, 25 %, all) it checks that logits and greedy tokens are bit-identical to the
same build with every expert resident at the same micro-batch size (pools live in device memory;
the remap runs on the host), and reports how far the GPU results are from the CPU ones. With
--speed it times decode and reports the host round trip per MoE layer (remap time / remaps).
With --waves it times a prompt at 25 % slots, in waves, with the pairs of other waves skipped by
the kernels (Vulkan, CPU) and masked (EMPANEL_WAVE_MASK=1: every pair multiplied in every wave).
Prints a markdown table and, with --json, writes every number.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from empanel_gguf import Llama  # noqa: E402
from empanel_gguf.models import fixtures  # noqa: E402
from empanel_gguf.lab.exactness import greedy_logits  # noqa: E402

PROMPT = b"The quick brown fox jumps over the lazy dog, and then"
DEFAULT_FIXTURES = ("qwen3moe-f16", "qwen3moe-q4_0", "qwen3moe-q4_k", "qwen2moe", "deepseek2",
                    "gpt-oss", "mixtral", "qwen3moe-256x")


def run(path, moe_slots, n_ubatch, n_gpu_layers, n_greedy):
    """(logits of prompt + greedy tokens, tokens, stats, n_ubatch used)."""
    llm = Llama(str(path), n_ctx=256, n_batch=64, n_ubatch=n_ubatch, n_gpu_layers=n_gpu_layers,
                logits_all=True, seed=0, verbose=False, moe_slots=moe_slots)
    try:
        logits, tokens = greedy_logits(llm, PROMPT, n_greedy)
        return logits, tokens, llm.moe_stats(), llm.context_params.n_ubatch
    finally:
        llm.close()


def check_exactness(names, n_gpu_layers, n_greedy, workdir):
    rows = []
    for name in names:
        spec = fixtures.FIXTURES[name]
        path = fixtures.write_fixture(name, workdir)
        for slots in (spec.n_expert_used, "25%", spec.n_expert):
            t0 = time.perf_counter()
            logits, tokens, stats, n_ubatch = run(path, slots, 512, n_gpu_layers, n_greedy)
            ref, ref_tokens, _, _ = run(path, None, n_ubatch, n_gpu_layers, n_greedy)
            cpu, cpu_tokens, _, _ = run(path, None, n_ubatch, 0, n_greedy)
            # vs the CPU: only rows whose inputs agree (another backend may pick another greedy
            # token, after which the two runs see different text)
            agree = 0
            while agree < len(tokens) and agree < len(cpu_tokens) and tokens[agree] == cpu_tokens[agree]:
                agree += 1
            rows_same_input = logits.shape[0] - len(tokens) + agree
            total = stats["total"]
            rows.append({
                "fixture": name, "moe_slots": slots, "n_ubatch": n_ubatch,
                "bit_identical": bool(np.array_equal(logits, ref)) and tokens == ref_tokens,
                "max_diff_vs_resident": float(np.abs(logits - ref).max()),
                "max_diff_vs_cpu": float(np.abs(logits[:rows_same_input] - cpu[:rows_same_input]).max()),
                "greedy_tokens_as_cpu": f"{agree}/{len(tokens)}",
                "hit_rate": total["hit_rate"], "misses": total["misses"],
                "round_trip_us": 1e6 * total["remap_s"] / max(1, total["n_remaps"]),
                "syncs_per_token": total["device_syncs_per_token"],
                "seconds": time.perf_counter() - t0,
            })
            print(f"{name:16s} slots={str(slots):>4s} ub={n_ubatch:3d} identical={rows[-1]['bit_identical']} "
                  f"vs-cpu={rows[-1]['max_diff_vs_cpu']:.2e}", file=sys.stderr)
    return rows


def time_decode(path, moe_slots, n_gpu_layers, n_gen, n_ubatch):
    llm = Llama(str(path), n_ctx=512, n_ubatch=n_ubatch, n_gpu_layers=n_gpu_layers, seed=0,
                verbose=False, moe_slots=moe_slots)
    try:
        llm.eval(llm.tokenize(PROMPT))
        if llm.moe_stats() is not None:
            llm._experts.reset_stats()
        t0 = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        dt = time.perf_counter() - t0
        stats = llm.moe_stats()
        row = {"moe_slots": moe_slots, "decode_tok_s": n_gen / dt}
        if stats is not None:
            t = stats["total"]
            row.update(hit_rate=t["hit_rate"], round_trip_us=1e6 * t["remap_s"] / max(1, t["n_remaps"]),
                       read_gbps=t["read_gbps"], syncs_per_token=t["device_syncs_per_token"])
        return row
    finally:
        llm.close()


def time_prompt(path, moe_slots, n_gpu_layers, n_prompt, masked, repeat=2):
    """Best of `repeat` prompt evaluations of n_prompt token ids; masked: EMPANEL_WAVE_MASK=1."""
    saved = os.environ.get("EMPANEL_WAVE_MASK")
    os.environ["EMPANEL_WAVE_MASK"] = "1" if masked else "0"
    try:
        llm = Llama(str(path), n_ctx=max(512, n_prompt + 8), n_gpu_layers=n_gpu_layers, seed=0,
                    verbose=False, moe_slots=moe_slots)
    finally:
        if saved is None:
            del os.environ["EMPANEL_WAVE_MASK"]
        else:
            os.environ["EMPANEL_WAVE_MASK"] = saved
    try:
        tokens = list(np.random.default_rng(0).integers(100, llm.n_vocab(), n_prompt))
        if llm.moe_stats() is not None:
            llm._experts.reset_stats()  # the evaluations' reads only, not the load's
        best = float("inf")
        for _ in range(repeat):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(tokens)
            best = min(best, time.perf_counter() - t0)
        row = {"moe_slots": moe_slots, "masked": masked, "n_prompt": n_prompt, "prompt_s": best}
        stats = llm.moe_stats()
        if stats is not None:
            t = stats["total"]
            # per evaluation: reads, the graph's waits for them, writes into device slots
            row.update(masked_pools=t["masked_pools"], waves_per_remap=t["n_waves"] / max(1, t["n_remaps"]),
                       read_s=t["read_s"] / repeat, wait_s=t["wait_s"] / repeat, write_s=t["write_s"] / repeat)
        return row
    finally:
        llm.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixtures", default=",".join(DEFAULT_FIXTURES))
    parser.add_argument("-ngl", "--n-gpu-layers", type=int, default=99)
    parser.add_argument("-n", "--n-greedy", type=int, default=16)
    parser.add_argument("--speed", metavar="MODEL", help="also time decode on this model")
    parser.add_argument("--n-gen", type=int, default=64)
    parser.add_argument("--waves", metavar="MODEL", help="time a prompt in waves, skipping vs masked")
    parser.add_argument("--n-prompt", type=int, default=256)
    parser.add_argument("--json", help="write all rows here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as workdir:
        names = [name for name in args.fixtures.split(",") if name]
        rows = check_exactness(names, args.n_gpu_layers, args.n_greedy, workdir)
    print("| fixture | moe_slots | n_ubatch | bit-identical | max diff vs CPU (same inputs) | hit rate "
          "| round trip µs/layer | device syncs/token |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fixture']} | {r['moe_slots']} | {r['n_ubatch']} | {'yes' if r['bit_identical'] else 'NO'} "
              f"| {r['max_diff_vs_cpu']:.3g} | {100 * r['hit_rate']:.1f}% | {r['round_trip_us']:.0f} "
              f"| {r['syncs_per_token']:.1f} |")
    speed = []
    if args.speed:
        resident = time_decode(args.speed, None, args.n_gpu_layers, args.n_gen, 1)
        speed.append(resident)
        for slots in ("100%", "25%"):
            speed.append(time_decode(args.speed, slots, args.n_gpu_layers, args.n_gen, 1))
        print("\n| moe_slots | decode tok/s | vs resident | hit rate | round trip µs/layer | read GB/s | syncs/token |")
        print("|---|---|---|---|---|---|---|")
        for r in speed:
            print(f"| {r['moe_slots']} | {r['decode_tok_s']:.1f} | {r['decode_tok_s'] / resident['decode_tok_s']:.2f} "
                  f"| {100 * r.get('hit_rate', 1.0):.1f}% | {r.get('round_trip_us', 0):.0f} | {r.get('read_gbps', 0):.2f} "
                  f"| {r.get('syncs_per_token', 0):.1f} |")
    waves = []
    if args.waves:
        waves.append(time_prompt(args.waves, None, args.n_gpu_layers, args.n_prompt, False))
        for masked in (False, True):
            waves.append(time_prompt(args.waves, "25%", args.n_gpu_layers, args.n_prompt, masked))
        print(f"\n| prompt of {args.n_prompt} | moe_slots | waves | seconds | vs resident | masked pools "
              "| waits for reads s | device slot writes s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in waves:
            kind = "resident" if r["moe_slots"] is None else ("masked" if r["masked"] else "skipping")
            print(f"| {kind} | {r['moe_slots']} | {r.get('waves_per_remap', 1):.1f} | {r['prompt_s']:.2f} "
                  f"| {waves[0]['prompt_s'] / r['prompt_s']:.2f} | {r.get('masked_pools', 0)} "
                  f"| {r.get('wait_s', 0):.2f} | {r.get('write_s', 0):.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"exactness": rows, "speed": speed, "waves": waves}, f, indent=1)
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
