"""The bench's real shapes (empanel-gguf bench --shape; lab/bench/synthetic.py): the full-size plans
follow llama-quantize's recipe and weigh what the real files weigh (computed, never written); a
scaled-down model of each shape, written by the same writer, loads in llama.cpp and its slot pools'
logits equal stock llama.cpp's as moe_stats()["exact_to"] names it; random blocks of every type
dequantize to finite weights of the wanted spread; the synthetic shape's file stays what it was.
"""

import math

import gguf
import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.lab.bench import blocks, cli, recipe
from empanel_gguf.lab.bench.synthetic import (SHAPES, ModelShape, plan_bytes, plan_types, shape_fingerprint,
                                              shape_with, tensor_bytes, tensor_plan, write_model)
from empanel_gguf.lab.exactness import greedy_logits
from empanel_gguf.models.fixtures import MlaDims

TEXT = b"The quick brown fox jumps over the lazy dog, and then"

# The real files' sizes (GB, 1e9 bytes): Qwen/Qwen3-30B-A3B-GGUF Q4_K_M, ggml-org/gpt-oss-20b-GGUF
# mxfp4, DeepSeek-V2-Lite Q4_K_M; the plans hold tensor data only (the files add ~5 MB of metadata)
REAL_GB = {"qwen3-30b-a3b-q4_k_m": 18.6, "gpt-oss-20b": 12.1, "deepseek-v2-lite": 10.4}

# Scaled down, same arch and tensor types per kind: rows that are (or are not) a multiple of 256
# where the full shape's are, not 8 experts (the recipe's 8-expert rules), layers on both sides of
# use_more_bits; qwen3 keeps the full 151,936-token vocabulary
SMALL = {
    "qwen3-30b-a3b-q4_k_m": dict(n_layer=2, n_expert=16, n_expert_used=4, n_embd=256, n_ff_exp=256,
                                 n_head=4, n_head_kv=2, head_dim=64, n_ff=512),
    "gpt-oss-20b": dict(n_layer=2, n_expert=8, n_expert_used=2, n_embd=192, n_ff_exp=96, n_head=4,
                        n_head_kv=2, head_dim=64, n_ff=96, n_vocab=4096),
    "deepseek-v2-lite": dict(n_layer=8, n_expert=16, n_expert_used=4, n_embd=256, n_ff_exp=128, n_ff=320,
                             n_head=4, n_vocab=4096,
                             mla=MlaDims(q_lora_rank=0, kv_lora_rank=256, rope_dim=32, nope_dim=32, v_dim=64,
                                         n_dense_lead=1, n_expert_shared=2, n_groups=0, n_groups_used=0,
                                         gating="softmax", weights_norm=False)),
}
NAMED = list(REAL_GB)


def by_layer(plan, suffix):
    """{layer: type} of the tensors blk.N.<suffix>."""
    return {int(t.name.split(".")[1]): t.qtype for t in plan if t.name.startswith("blk.") and t.name.endswith(suffix)}


def more_bits(n_layer):
    """The layers Q4_K_M gives more bits (llama-quant.cpp's use_more_bits), spelled out."""
    eighth = n_layer // 8
    return set(range(eighth)) | set(range(7 * n_layer // 8, n_layer)) | {
        i for i in range(eighth, 7 * n_layer // 8) if (i - eighth) % 3 == 2}


# -- the full-size plans (no file written)


def test_qwen3_30b_a3b_plan_is_the_q4_k_m_recipe():
    plan = tensor_plan(SHAPES["qwen3-30b-a3b-q4_k_m"])
    hot = more_bits(48)
    assert len(hot) == 24 and {0, 5, 8, 11, 41, 42, 47} <= hot and not {6, 7, 9, 40} & hot
    for suffix in ("attn_v.weight", "ffn_down_exps.weight"):
        assert by_layer(plan, suffix) == {il: "Q6_K" if il in hot else "Q4_K" for il in range(48)}, suffix
    for suffix in ("attn_q.weight", "attn_k.weight", "attn_output.weight", "ffn_gate_exps.weight",
                   "ffn_up_exps.weight"):
        assert set(by_layer(plan, suffix).values()) == {"Q4_K"}, suffix
    types = {t.name: t.qtype for t in plan}
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.0.attn_q_norm.weight"] == "F32"
    assert {t.ne[-1] for t in plan if t.name in ("token_embd.weight", "output.weight")} == {151936}
    # the file's type counts (the f32 / q4_K / q6_K counts llama.cpp's loader prints for the real one)
    assert {q: sum(n for c in plan_types(plan).values() for t, n in c.items() if t == q)
            for q in ("F32", "Q4_K", "Q6_K")} == {"F32": 241, "Q4_K": 289, "Q6_K": 49}
    # expert bytes differ by layer: a Q6_K ffn_down makes one expert 2.65 -> 3.06 MB
    expert = {il: sum(tensor_bytes(t) for t in plan if t.name.startswith(f"blk.{il}.") and "_exps" in t.name) // 128
              for il in (0, 6)}
    assert expert == {0: 3059712, 6: 2654208}


def test_gpt_oss_20b_plan_is_mxfp4_experts_and_q8_0():
    plan = tensor_plan(SHAPES["gpt-oss-20b"])
    assert len(plan) == 459  # as ggml-org/gpt-oss-20b-GGUF's file
    for t in plan:
        if t.name.endswith("_exps.weight"):
            assert t.qtype == "MXFP4" and t.ne == ((2880, 2880, 32)), t
        elif len(t.ne) >= 2 and t.name.endswith(".weight") and "gate_inp" not in t.name:
            assert t.qtype == "Q8_0", t
        else:
            assert t.qtype == "F32", t  # norms, router, sinks, biases
    names = {t.name for t in plan}
    assert {"blk.0.attn_sinks.weight", "blk.0.attn_q.bias", "blk.23.ffn_down_exps.bias"} <= names
    assert SHAPES["gpt-oss-20b"].sliding_window == 128


def test_deepseek_v2_lite_plan_falls_back_where_rows_are_not_k_quants():
    shape = SHAPES["deepseek-v2-lite"]
    plan = tensor_plan(shape)
    hot = more_bits(27)
    types = {t.name: t.qtype for t in plan}
    # the dense first layer: ffn_down 10944 wide, Q6_K by use_more_bits -> Q8_0
    assert (types["blk.0.ffn_gate.weight"], types["blk.0.ffn_down.weight"]) == ("Q4_K", "Q8_0")
    assert "blk.0.ffn_gate_exps.weight" not in types
    # routed experts: 1408-wide down rows cannot be K-quants, Q4_K -> Q5_0, Q6_K -> Q8_0
    assert by_layer(plan, "ffn_down_exps.weight") == {il: "Q8_0" if il in hot else "Q5_0" for il in range(1, 27)}
    assert set(by_layer(plan, "ffn_gate_exps.weight").values()) == {"Q4_K"}
    # 2 shared experts of 1408: 2816 = 11 x 256, so K-quants
    assert by_layer(plan, "ffn_down_shexp.weight") == {il: "Q6_K" if il in hot else "Q4_K" for il in range(1, 27)}
    # MLA: no q lora; k_b rows are nope (128) wide
    assert set(by_layer(plan, "attn_k_b.weight").values()) == {"Q5_0"}
    for suffix in ("attn_q.weight", "attn_kv_a_mqa.weight", "attn_v_b.weight", "attn_output.weight"):
        assert set(by_layer(plan, suffix).values()) == {"Q4_K"}, suffix
    assert types["output.weight"] == "Q6_K" and len([n for n in types if n.endswith("ffn_gate_inp.weight")]) == 26


@pytest.mark.parametrize("name", NAMED)
def test_full_size_plans_weigh_what_the_real_files_weigh(name):
    total = plan_bytes(tensor_plan(SHAPES[name]))
    assert total / 1e9 == pytest.approx(REAL_GB[name], rel=0.01)


def test_the_recipes_fallbacks():
    assert recipe.fallback("Q4_K", 1408) == "Q5_0" and recipe.fallback("Q6_K", 1408) == "Q8_0"
    assert recipe.fallback("Q5_K", 1408) == "Q5_1" and recipe.fallback("Q4_K", 2816) == "Q4_K"
    assert recipe.fallback("Q4_K", 100) == "F16"
    # 8 experts: Q8_0 attn_k / attn_v, Q5_K attn_output (Mixtral's rules)
    types = recipe.tensor_types([("blk.0.attn_k.weight", (256, 256)), ("blk.0.attn_v.weight", (256, 256)),
                                 ("blk.0.attn_output.weight", (256, 256))], "q4_k_m", n_expert=8, n_layer=1)
    assert types == {"blk.0.attn_k.weight": "Q8_0", "blk.0.attn_v.weight": "Q8_0", "blk.0.attn_output.weight": "Q5_K"}


# -- scaled-down models, written and run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shapes")


def run(path, moe_slots, **kwargs):
    """(logits of TEXT + 4 greedy tokens, the greedy tokens, moe_stats, text round trip, n_vocab)."""
    llm = Llama(str(path), n_ctx=128, logits_all=True, verbose=False, moe_slots=moe_slots, **kwargs)
    try:
        logits, tokens = greedy_logits(llm, TEXT, 4)
        return logits, tokens, llm.moe_stats(), llm.detokenize(llm.tokenize(TEXT, add_bos=False)), llm.n_vocab()
    finally:
        llm.close()


@pytest.mark.parametrize("name", NAMED)
def test_scaled_down_shape_runs_on_pools_bit_identical_to_stock(name, model_dir):
    shape = shape_with(name, **SMALL[name])
    full, small = plan_types(tensor_plan(SHAPES[name])), plan_types(tensor_plan(shape))
    assert {k: set(v) for k, v in small.items()} == {k: set(v) for k, v in full.items()}  # same types per kind
    path = write_model(shape, model_dir / f"{name}.gguf", log=lambda *a: None)
    reader = gguf.GGUFReader(path)
    assert {t.name: t.tensor_type.name for t in reader.tensors} == {t.name: t.qtype for t in tensor_plan(shape)}

    logits, tokens, stats, round_trip, n_vocab = run(path, shape.n_expert_used)  # the smallest pools: they page
    assert n_vocab == shape.vocab_size and round_trip == TEXT  # the padded vocabulary still tokenizes text
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 3
    assert stats["total"]["misses"] > 0
    ref_logits, ref_tokens, ref_stats, _, _ = run(path, None, **stats["exact_kwargs"])
    assert ref_stats is None and tokens == ref_tokens
    assert np.array_equal(logits, ref_logits), f"{stats['exact_to']}: max |diff| {np.abs(logits - ref_logits).max()}"


def test_a_file_written_from_the_same_shape_is_reused(model_dir):
    shape = shape_with("gpt-oss-20b", **SMALL["gpt-oss-20b"])
    path = write_model(shape, model_dir / "gpt-oss-20b.gguf", log=lambda *a: None)
    mtime = path.stat().st_mtime_ns
    assert write_model(shape, path, log=lambda *a: None) == path and path.stat().st_mtime_ns == mtime
    other = shape_with("gpt-oss-20b", **{**SMALL["gpt-oss-20b"], "routing_locality": 0.5})
    assert shape_fingerprint(other) != shape_fingerprint(shape)


# -- the pieces


@pytest.mark.parametrize("qtype", blocks.TYPES)
def test_random_blocks_are_finite_with_the_wanted_spread(qtype):
    ne0 = 2816 if blocks.block_layout(qtype)[0] == 256 else 2880
    rows = blocks.random_rows(np.random.default_rng(1), qtype, 64, ne0, scale=2.0)
    values = rows.astype(np.float32) if qtype in blocks.FLOAT_TYPES else \
        gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[qtype])
    assert values.shape == (64, ne0) and np.isfinite(values).all()
    assert values.std() == pytest.approx(2.0 / math.sqrt(ne0), rel=0.05)
    assert abs(values.mean()) < 0.06 * values.std()


def test_the_synthetic_shape_is_the_file_it_was():
    """The first bench model (15.7 GiB, docs/performance.md) and its 12-layer versions keep their
    fingerprints, so files written before are reused."""
    assert SHAPES["synthetic"] == ModelShape()
    assert shape_fingerprint(ModelShape()) == "f8b088022cd170a6"
    assert shape_fingerprint(ModelShape(n_layer=12)) == "d0ab50f1ee531e0e"
    assert shape_fingerprint(ModelShape(n_layer=12, routing_skew=1.0)) == "6ae71f4c1fd8c9ab"
    assert plan_bytes(tensor_plan(ModelShape())) == 16_868_928_512  # 15.71 GiB


def test_shape_flag_and_overrides():
    parse = cli.setup_arg_parser().parse_args
    assert cli.shape_from_args(parse(["--write-model", "m.gguf"])) == SHAPES["qwen3-30b-a3b-q4_k_m"]
    shape = cli.shape_from_args(parse(["--write-model", "m.gguf", "--shape", "gpt-oss-20b", "--layers", "4",
                                       "--routing-skew", "0.5"]))
    assert shape == shape_with("gpt-oss-20b", n_layer=4, routing_skew=0.5) and shape.n_vocab == 201088
    synthetic = cli.shape_from_args(parse(["--write-model", "m.gguf", "--shape", "synthetic", "--experts", "16"]))
    assert synthetic == ModelShape(n_expert=16)
