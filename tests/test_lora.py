"""LoRA adapters over slot pools: one that leaves the routed experts alone gives the logits of the
same adapter on the model fully in memory; one that changes them is refused with a clear error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.lab.exactness import greedy_logits

KW = dict(n_ctx=256, n_threads=2, logits_all=True, seed=0, verbose=False)
PROMPT = b"Hello the world, and this is a test of adapters"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return fixtures.write_fixture("qwen3moe-f32", tmp_path_factory.mktemp("lora"))


def write_adapter(base_path, path, targets, rank=4, seed=0):
    """A LoRA adapter GGUF for the tensors `targets` of the base model, random deltas."""
    shapes = {t.name: [int(n) for n in t.shape] for t in gguf.GGUFReader(base_path).tensors}  # ggml order
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank))
    for name in targets:
        ne = shapes[name]
        # lora_a [ne0 = in, rank (, experts)], lora_b [rank, ne1 = out (, experts)]; numpy order reversed
        extra = ne[2:][::-1]
        w.add_tensor(f"{name}.lora_a", (rng.standard_normal(extra + [rank, ne[0]]) * 0.2).astype(np.float32))
        w.add_tensor(f"{name}.lora_b", (rng.standard_normal(extra + [ne[1], rank]) * 0.2).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_adapter_on_attention_is_exact_over_slot_pools(base, tmp_path):
    adapter = write_adapter(base, tmp_path / "attn.gguf", ["blk.0.attn_q.weight", "blk.1.attn_output.weight"])
    logits = {}
    for label, moe_slots, lora in (("plain", None, None), ("stock", None, adapter), ("slots", 4, adapter),
                                   ("25%", "25%", adapter)):
        kwargs = dict(KW, lora_path=str(lora)) if lora else dict(KW)
        llm = Llama(str(base), moe_slots=moe_slots, **kwargs)
        try:
            logits[label], _ = greedy_logits(llm, PROMPT, n_greedy=8)
            if moe_slots is not None:
                assert llm.moe_stats()["total"]["misses"] > 0  # the pools were paging
        finally:
            llm.close()
    assert not np.array_equal(logits["plain"], logits["stock"])  # the adapter changes the model
    assert np.array_equal(logits["slots"], logits["stock"])
    assert np.array_equal(logits["25%"], logits["stock"])


def test_adapter_on_routed_experts_is_refused_with_slots(base, tmp_path):
    adapter = write_adapter(base, tmp_path / "exps.gguf", ["blk.0.attn_q.weight", "blk.1.ffn_up_exps.weight"])
    with pytest.raises(ValueError, match=r"routed-expert weights \(blk\.1\.ffn_up_exps\.weight\).*moe_slots=None"):
        Llama(str(base), moe_slots="25%", lora_path=str(adapter), **KW)
    llm = Llama(str(base), moe_slots="25%", **KW)  # nothing lost
    llm.close()
