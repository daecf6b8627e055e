"""One model of llama.cpp's random-model writer (test-llama-archs), checked on slot pools.

    python scripts/arch_check.py MODEL.gguf [--variant plain|prefetch|mask] [--json OUT]

Loads the model as stock llama-cpp-python does (no slots, its defaults: n_batch and n_ubatch
512), evaluates a prompt of token ids (the writer's files carry a dummy tokenizer) longer than a
wave at the smallest pool, then decodes greedily; then the same with slot pools at the minimum
(top-k) and at half the experts, and (--variant plain) stock and the minimum again with the prompt in
one call of several micro-batches (n_batch 256, n_ubatch 16). The result, one JSON object:

    {"arch", "file", "status": "ok" | "excluded" | "fail", "reason", "n_expert", "n_expert_used",
     "runs": [{"slots", "identical", "misses", "hits", "waves_per_batch"}]}

"ok": every run's logits are bit-identical to stock's and every run missed at least once.
"excluded" is asserted, never assumed: a file without routed experts, a graph that never routes
(identical logits, no remap ran), or a model stock itself cannot evaluate here, with slot pools
failing the same way. tests/test_archs.py runs this once
per architecture, each in its own process, so that a crash names its architecture.
--variant prefetch: moe_prefetch=1; mask: masked waves (EMPANEL_WAVE_MASK=1, set by the caller);
mtp: the file's MTP blocks loaded (moe_mtp=True, as llama.cpp's --spec-type draft-mtp), stock too.
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

N_PROMPT = 80  # tokens: every expert of every layer is routed, several waves at top-k slots
N_GREEDY = 8
N_CTX = 256    # the writer's training context
# the prompt in one call of 5 micro-batches (llama_decode splits it; each remaps on its own)
SEVERAL_MICRO_BATCHES = {"n_batch": N_CTX, "n_ubatch": 16}


def prompt_ids(n_vocab, n=N_PROMPT):
    """A fixed prompt of token ids that are not control tokens."""
    return [(7 + 13 * i) % (n_vocab - 2) + 1 for i in range(n)]


def evaluate(llm, prompt):
    """Logits of the prompt and of N_GREEDY greedy tokens after it (float32 [n, n_vocab]), and
    the tokens."""
    import numpy as np

    llm.eval(prompt)
    tokens = []
    for _ in range(N_GREEDY):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(nxt)
        llm.eval([nxt])
    return np.array(llm.scores[:llm.n_tokens], dtype=np.float32), tokens


def run(path, moe_slots, variant, **llama):
    from empanel_gguf import Llama

    moe = {"moe_slots": moe_slots, "moe_profile": None} if moe_slots is not None else {}
    if moe_slots is not None and variant == "prefetch":
        moe["moe_prefetch"] = 1
    if variant == "mtp":
        moe["moe_mtp"] = True
    llm = Llama(str(path), n_ctx=N_CTX, logits_all=True, n_threads=2, verbose=False, **moe, **llama)
    try:
        prompt = prompt_ids(llm.n_vocab())
        logits, tokens = evaluate(llm, prompt)
        stats = llm.moe_stats()
    finally:
        llm.close()
    return logits, tokens, stats


def check(path, variant="plain"):
    from empanel_gguf.planning.index import load_index

    path = Path(path)
    out = {"file": path.name, "variant": variant, "runs": []}
    try:
        index = load_index(path, mtp=variant == "mtp")
    except Exception as e:  # noqa: BLE001 - reported, the caller decides
        return dict(out, arch=path.stem, status="fail", reason=f"index: {type(e).__name__}: {e}")
    out.update(arch=index.architecture, n_expert=index.n_expert, n_expert_used=index.n_expert_used,
               moe_layers=len(index.layers), mtp_layers=index.mtp_layers, mtp_loaded=index.mtp_loaded)
    if not index.is_moe:
        return dict(out, status="excluded", reason="no routed expert in the file")
    k, half = index.n_expert_used, max(index.n_expert_used, index.n_expert // 2)
    try:
        ref_logits, ref_tokens, _ = run(path, None, variant)
    except Exception as stock_error:  # noqa: BLE001
        try:
            run(path, k, variant)
        except Exception as pool_error:  # noqa: BLE001
            if type(pool_error) is type(stock_error):
                return dict(out, status="excluded",
                            reason=f"stock fails the same way: {type(stock_error).__name__}: {stock_error}")
            return dict(out, status="fail", reason=f"stock: {stock_error}; slot pools: {pool_error}")
        return dict(out, status="fail", reason=f"stock fails ({stock_error}) but slot pools do not")
    status, reasons = "ok", []
    cases = [(slots, {}) for slots in sorted({k, half})]
    if variant == "plain":  # several micro-batches in one llama_decode call, stock the same
        cases.append((k, SEVERAL_MICRO_BATCHES))
    for slots, llama in cases:
        if llama:
            try:
                ref_logits, ref_tokens, _ = run(path, None, variant, **llama)
            except Exception as e:  # noqa: BLE001
                status = "fail"
                reasons.append(f"stock with {llama}: {type(e).__name__}: {e}")
                continue
        try:
            logits, tokens, stats = run(path, slots, variant, **llama)
        except Exception as e:  # noqa: BLE001
            out["runs"].append({"slots": slots, **llama, "error": f"{type(e).__name__}: {e}"})
            status = "fail"
            reasons.append(f"{slots} slots: {type(e).__name__}: {e}")
            continue
        total = stats["total"] if stats else {}
        identical = logits.shape == ref_logits.shape and logits.tobytes() == ref_logits.tobytes() \
            and tokens == ref_tokens
        out["runs"].append({"slots": slots, **llama, "identical": identical, "remaps": total.get("n_remaps", 0),
                            "misses": total.get("misses", 0), "hits": total.get("hits", 0),
                            "waves_per_batch": round(total.get("waves_per_batch", 0), 2)})
        if not identical:
            status = "fail"
            diff = float(abs(logits - ref_logits).max()) if logits.shape == ref_logits.shape else None
            reasons.append(f"{slots} slots: logits differ from stock (max |diff| {diff})")
        elif not total.get("misses"):
            status = "fail"
            reasons.append(f"{slots} slots: no miss (the pools never paged)")
    if status == "ok" or all(run.get("identical") and not run.get("remaps") for run in out["runs"]):
        if out["runs"] and not any(run.get("remaps") for run in out["runs"]):
            # identical, but nothing was paged: llama.cpp loads the expert tensors, the graph never uses them
            return dict(out, status="excluded", reason="its graph never routes experts (no remap ran; the expert "
                                                        "tensors are loaded but the FFN is dense)")
    return dict(out, status=status, reason="; ".join(reasons))


def doc_table(results):
    """docs/architectures.md's tables from the sweep's results (EMPANEL_ARCHS_REPORT of
    tests/test_archs.py)."""
    ok = sorted((r for r in results if r["status"] == "ok"), key=lambda r: r["arch"])
    other = sorted((r for r in results if r["status"] != "ok"), key=lambda r: r["arch"])
    lines = [f"{len(ok)} architectures run bit-identical on slot pools; {len(other)} excluded.", "",
             "| architecture | MoE layers | experts (used) | waves per micro-batch at top-k | misses at top-k / half |",
             "|---|---|---|---|---|"]
    for r in ok:
        sized = [run for run in r["runs"] if "n_ubatch" not in run]
        low, high = sized[0], sized[-1]
        lines.append(f"| `{r['arch']}` | {r['moe_layers']} | {r['n_expert']} ({r['n_expert_used']}) | "
                     f"{low['waves_per_batch']} | {low['misses']} / {high['misses']} |")
    if other:
        lines += ["", "Excluded:", "", "| architecture | why |", "|---|---|"]
        lines += [f"| `{r['arch']}` | {r['reason']} |" for r in other]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model file, or with --doc the sweep's JSON report")
    parser.add_argument("--variant", choices=("plain", "prefetch", "mask", "mtp"), default="plain")
    parser.add_argument("--json", help="write the result here (default: stdout)")
    parser.add_argument("--doc", action="store_true", help="print docs/architectures.md's tables from a report")
    args = parser.parse_args(argv)
    if args.doc:
        print(doc_table(json.loads(Path(args.model).read_text())), end="")
        return 0
    result = check(args.model, args.variant)
    text = json.dumps(result)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    return 0 if result["status"] != "fail" else 1


if __name__ == "__main__":
    sys.exit(main())
