"""The tiny MoE fixtures: written deterministically, cached, and loadable by llama.cpp.

Loading needs llama-cpp-python with a llama.cpp library (LLAMA_CPP_LIB_PATH); without one those
tests are skipped, the pure-Python ones still run.
"""

from __future__ import annotations

import importlib

import gguf
import numpy as np
import pytest

from empanel_gguf.models import fixtures

PROMPT = b"Hello the world, and this is a test"
N_GENERATE = 8


def _llama_cpp():
    try:
        return importlib.import_module("llama_cpp")
    except (ImportError, OSError, RuntimeError) as err:  # no library found or loadable
        pytest.skip(f"llama_cpp is not usable here: {err}")


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fixtures")


@pytest.fixture(scope="session")
def model_paths(fixture_dir):
    """name -> the path to load, each fixture written once per session."""
    paths = {}
    for name, spec in fixtures.FIXTURES.items():
        if spec.requantize_to is not None:
            continue  # needs llama.cpp: written by the tests that use it
        paths[name] = fixtures.write_fixture(name, fixture_dir)
    return paths


def _model_path(name, model_paths, fixture_dir):
    if name not in model_paths:
        _llama_cpp()
        model_paths[name] = fixtures.write_fixture(name, fixture_dir)
    return model_paths[name]


def _expert_types_by_layer(path):
    """{layer: {expert tensor type names}} from a GGUF file."""
    types = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.name.endswith("_exps.weight"):
            layer = int(tensor.name.split(".")[1])
            types.setdefault(layer, set()).add(tensor.tensor_type.name)
    return types


def _assert_sane(logits):
    assert np.all(np.isfinite(logits)), "non-finite logits"
    assert np.all(logits.max(axis=-1) > logits.min(axis=-1)), "a row of equal logits"
    assert np.abs(logits).max() < 1e4, "logits blew up"


@pytest.mark.parametrize("name", list(fixtures.FIXTURES))
def test_loads_evaluates_and_generates(name, model_paths, fixture_dir):
    llama_cpp = _llama_cpp()
    path = _model_path(name, model_paths, fixture_dir)
    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False, seed=1234,
                          n_threads=2, n_batch=64)
    try:
        tokens = llm.tokenize(PROMPT)
        assert len(tokens) > 5
        llm.eval(tokens)
        prompt_logits = np.array(llm.scores[: llm.n_tokens])  # (n_prompt, n_vocab)
        assert prompt_logits.shape == (len(tokens), llm.n_vocab())
        _assert_sane(prompt_logits)
        # different positions see different tokens, so their logits differ
        assert not np.allclose(prompt_logits[-1], prompt_logits[-2])

        # greedy decoding, one token at a time, past any end-of-generation token
        generated = []
        for _ in range(N_GENERATE):
            last = np.array(llm.scores[llm.n_tokens - 1])
            _assert_sane(last)
            token = int(np.argmax(last))
            generated.append(token)
            llm.eval([token])
        assert len(generated) == N_GENERATE
        assert all(0 <= t < llm.n_vocab() for t in generated)
    finally:
        llm.close()


def test_chat_completion_uses_the_template(model_paths):
    llama_cpp = _llama_cpp()
    llm = llama_cpp.Llama(str(model_paths["qwen3moe-f32"]), n_ctx=256, verbose=False,
                          n_threads=2)
    try:
        reply = llm.create_chat_completion(
            messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0.0)
        assert isinstance(reply["choices"][0]["message"]["content"], str)
        assert reply["usage"]["prompt_tokens"] > 5  # the template's markers were added
    finally:
        llm.close()


def test_q4_k_experts_are_q4_k(model_paths, fixture_dir):
    path = _model_path("qwen3moe-q4_k", model_paths, fixture_dir)
    types = _expert_types_by_layer(path)
    assert types == {0: {"Q4_K"}, 1: {"Q4_K"}}


def test_mixed_has_a_different_expert_type_per_layer(model_paths):
    types = _expert_types_by_layer(model_paths["qwen3moe-mixed"])
    assert types == {0: {"Q8_0"}, 1: {"Q4_0"}, 2: {"F16"}}


def test_gpt_oss_experts_are_mxfp4(model_paths):
    types = _expert_types_by_layer(model_paths["gpt-oss"])
    assert types == {0: {"MXFP4"}, 1: {"MXFP4"}}


def test_split_has_two_shards_with_disjoint_tensors(model_paths, fixture_dir):
    first = model_paths["qwen3moe-split"]
    assert first.name == "qwen3moe-split-00001-of-00002.gguf"
    second = fixture_dir / "qwen3moe-split-00002-of-00002.gguf"
    assert second.is_file()

    readers = [gguf.GGUFReader(first), gguf.GGUFReader(second)]
    names = [{t.name for t in r.tensors} for r in readers]
    assert names[0] and names[1] and not names[0] & names[1]
    for index, reader in enumerate(readers):
        assert reader.get_field("split.no").contents() == index
        assert reader.get_field("split.count").contents() == 2
        assert reader.get_field("split.tensors.count").contents() == len(names[0] | names[1])
    # every tensor of the unsplit model is in exactly one shard
    unsplit = {t.name for t in gguf.GGUFReader(model_paths["qwen3moe-f16"]).tensors}
    assert names[0] | names[1] == unsplit


@pytest.mark.parametrize("name, required", [
    ("qwen2moe", ["blk.0.ffn_gate_inp_shexp.weight", "blk.0.ffn_up_shexp.weight"]),
    ("deepseek2", ["blk.0.ffn_gate.weight", "blk.1.exp_probs_b.bias", "blk.1.attn_k_b.weight",
                   "blk.1.ffn_down_shexp.weight", "blk.2.ffn_up_exps.weight"]),
    ("gpt-oss", ["blk.0.attn_sinks.weight", "blk.0.ffn_down_exps.bias",
                 "blk.1.ffn_gate_inp.bias"]),
    ("mixtral", ["blk.1.ffn_gate_exps.weight"]),
])
def test_arch_specific_tensors_are_present(name, required, model_paths):
    names = {t.name for t in gguf.GGUFReader(model_paths[name]).tensors}
    assert set(required) <= names
    if name == "deepseek2":
        assert "blk.0.ffn_gate_exps.weight" not in names  # the leading dense layer


def test_256_experts_top_8(model_paths):
    reader = gguf.GGUFReader(model_paths["qwen3moe-256x"])
    assert reader.get_field("qwen3moe.expert_count").contents() == 256
    assert reader.get_field("qwen3moe.expert_used_count").contents() == 8
    gate = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    assert list(gate.shape) == [64, 32, 256]  # {n_embd, n_ff_exp, n_expert}


def test_same_spec_gives_the_same_bytes(tmp_path, model_paths):
    again = fixtures.write_model(fixtures.FIXTURES["gpt-oss"], tmp_path / "gpt-oss.gguf")
    assert again.read_bytes() == model_paths["gpt-oss"].read_bytes()


def test_cached_files_are_reused_and_bad_ones_rewritten(tmp_path):
    path = fixtures.write_fixture("olmoe", tmp_path)
    stamp = path.stat().st_mtime_ns
    assert fixtures.write_fixture("olmoe", tmp_path) == path
    assert path.stat().st_mtime_ns == stamp  # not rewritten

    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated
    assert fixtures.write_fixture("olmoe", tmp_path).read_bytes() == good

    other = fixtures.write_fixture("mixtral", tmp_path)
    path.write_bytes(other.read_bytes())  # a complete file, but from another spec
    assert fixtures.write_fixture("olmoe", tmp_path).read_bytes() == good
    assert not list(tmp_path.glob(".fixture-*"))  # no temporary folders left behind


def test_vocabulary_is_byte_level_bpe():
    tokens, types, merges = fixtures.vocabulary()
    assert len(tokens) == len(types) == 256 + len(fixtures.MERGES) + len(fixtures.CONTROL_TOKENS)
    assert len(set(tokens)) == len(tokens)
    assert tokens[ord("A")] == "A" and tokens[ord(" ")] == "Ġ"
    for merge in merges:
        left, right = merge.split(" ")
        assert left + right in tokens
