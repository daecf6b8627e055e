"""The tensor types llama.cpp's `llama-quantize` gives a model, for the benchmark's model writer.

A port of the pinned llama.cpp's src/llama-quant.cpp (tensor_allows_quantization,
tensor_get_category, llama_tensor_get_type_impl, tensor_type_fallback) for the recipes the
benchmark's shapes use; the rules of other recipes (Q2_K, IQ*, ...) and of other archs (Falcon,
70B, GLM5-Next, BailingMoE3) are left out. Recipes:

    pure-q4_k   every quantizable matrix Q4_K (`llama-quantize --pure ... Q4_K_M`): the synthetic shape
    q4_k_m      LLAMA_FTYPE_MOSTLY_Q4_K_M: Q4_K, with Q6_K for output.weight and, on the layers
                use_more_bits picks (the first and last eighth, every third between), for attn_v
                (attn_qkv, attn_kv_b) and ffn_down(_exps/_shexp); 8-expert models get Q8_0
                attn_k/attn_v and Q5_K attn_output. Rows not a multiple of 256 fall back: Q4_K ->
                Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (output.weight: Q8_0)
    mxfp4_moe   LLAMA_FTYPE_MOSTLY_MXFP4_MOE: 3-D (expert) matrices MXFP4, every other matrix Q8_0

Tensors llama-quantize leaves alone (1-D, norms, routers, biases) keep their source type, F32 here
as convert_hf_to_gguf.py writes them.
"""

from __future__ import annotations

import re

RECIPES = ("pure-q4_k", "q4_k_m", "mxfp4_moe")
SOURCE_TYPE = "F32"  # what the unquantized tensors are (convert_hf_to_gguf.py's F32 for 1-D, norms, routers)

# tensor_type_fallback: a 256-value block type whose rows do not divide -> a 32-value one
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_BLOCK = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q2_K": 256, "Q3_K": 256,
          "Q4_0": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "MXFP4": 32, "F16": 1, "F32": 1}


def quantizable(name: str, ne) -> bool:
    """tensor_allows_quantization for the tensors our archs have: 2-D and 3-D weights but norms
    and routers (ffn_gate_inp)."""
    return (len(ne) >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name)


def category(name: str) -> str:
    """tensor_get_category: the broad kind of tensor the rules speak of."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                      ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                      ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                      ("ffn_down", "ffn_down")):
        if part in name:
            return cat
    return "other"


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """The layers Q4_K_M gives more bits: the first and last eighth, and every third between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def layer_of(name: str) -> int:
    """The layer of blk.N.* (-1 for the others): llama.cpp's weights_map orders by it, then by name."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def fallback(qtype: str, ne0: int) -> str:
    """tensor_type_fallback: a type whose block divides the rows of ne0 values."""
    if ne0 % _BLOCK[qtype] == 0:
        return qtype
    new = _FALLBACK.get(qtype, qtype)
    return new if ne0 % _BLOCK[new] == 0 else "F16"


def tensor_types(tensors, recipe: str, n_expert: int, n_layer: int) -> dict[str, str]:
    """name -> ggml type name for `tensors` ((name, ne) pairs, ne in ggml order) under `recipe`,
    for a model of n_expert routed experts and n_layer layers."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: {', '.join(RECIPES)}")
    quant = sorted(((name, tuple(ne)) for name, ne in tensors if quantizable(name, ne)),
                   key=lambda t: (layer_of(t[0]), t[0]))  # llama.cpp's order (the attn_v counter)
    n_attn_v = sum(category(name) in ("attn_v", "attn_qkv", "attn_kv_b") for name, _ in quant)
    types, i_attn_v = {name: SOURCE_TYPE for name, _ in tensors}, 0
    for name, ne in quant:
        cat = category(name)
        if recipe == "pure-q4_k":
            qtype = "Q4_K"
        elif recipe == "mxfp4_moe":
            qtype = "Q8_0" if cat == "output" or len(ne) < 3 or ne[2] <= 1 else "MXFP4"
        else:
            qtype = _q4_k_m(name, ne, cat, i_attn_v, n_attn_v, n_expert, n_layer)
            i_attn_v += cat in ("attn_v", "attn_qkv", "attn_kv_b")
        types[name] = fallback(qtype, ne[0])
    return types


def _q4_k_m(name, ne, cat, i_attn_v, n_attn_v, n_expert, n_layer) -> str:
    """llama_tensor_get_type_impl for LLAMA_FTYPE_MOSTLY_Q4_K_M (default type Q4_K), untied
    embeddings (output.weight present), MoE (n_expert > 1), not Falcon, not a 70B."""
    if cat == "output":
        return "Q8_0" if ne[0] % 256 else "Q6_K"
    if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
        # (attn_qkv takes this branch too: the recipe's later Q5_K rule for it is never reached)
        if n_expert == 8:
            return "Q8_0"
        return "Q6_K" if use_more_bits(i_attn_v, n_attn_v) else "Q4_K"
    if cat == "attn_k" and n_expert == 8:
        return "Q8_0"
    if cat == "ffn_down":
        # MoE models: the layer from the name (llama.cpp's layer_info; n_layer = n_layer_all)
        return "Q6_K" if use_more_bits(layer_of(name), n_layer) else "Q4_K"
    if cat == "attn_output" and n_expert == 8:
        return "Q5_K"
    return "Q4_K"
