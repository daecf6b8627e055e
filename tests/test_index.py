"""empanel_gguf.planning.index and `empanel-gguf inspect`, checked against llama.cpp's own GGUF parser
(libggml-base.so through ctypes, from $LLAMA_CPP_LIB_PATH) and gguf-py's GGUFReader, on real
GGUF files written to disk."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from empanel_gguf.commands import inspect as inspect_cmd
from empanel_gguf.planning.index import ModelError, load_index

try:
    from empanel_gguf.models.fixtures import FIXTURES, write_fixture
except ImportError:  # the fixtures module is written in parallel; use it once it exists
    FIXTURES, write_fixture = {}, None

Q = gguf.GGMLQuantizationType


# --------------------------------------------------------------------------------------------
# Writing small GGUFs


def _tensor_bytes(rng: np.random.Generator, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """Random raw bytes for a ggml tensor of `shape` (ggml order, ne0 first), as GGUFWriter wants them."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    byte_shape = tuple(reversed(shape[1:])) + (shape[0] // block_size * type_size,)
    return rng.integers(0, 256, size=byte_shape, dtype=np.uint8)


def write_gguf(path: Path, arch: str, n_layer: int, tensors: list[tuple[str, Q, tuple[int, ...]]], *,
               n_expert: int | None = None, top_k: int | None = None, alignment: int | None = None,
               split_max_tensors: int = 0, seed: int = 0, uint32_kv: dict | None = None) -> Path:
    """Write a GGUF with the given (name, type, ggml shape) tensors of random bytes; returns the
    first file's path."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_block_count(n_layer)
    w.add_embedding_length(64)
    if n_expert is not None:
        w.add_expert_count(n_expert)
    if top_k is not None:
        w.add_expert_used_count(top_k)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value in (uint32_kv or {}).items():
        w.add_uint32(key, value)
    # a string array, as in every real model's tokenizer, to exercise skipping arrays
    w.add_token_list(["<s>", "</s>", "hello", "wörld"])
    w.add_token_scores([0.0, 0.0, -1.5, -2.5])
    for name, qtype, shape in tensors:
        w.add_tensor(name, _tensor_bytes(rng, qtype, shape), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        n = len(w.tensors)
        return path.with_name(f"{path.stem}-00001-of-{n:05d}.gguf")
    return path


def moe_tensors(n_layer: int, n_embd: int, n_ff: int, n_expert: int, layer_types: dict[int, Q],
                dense_layers: tuple[int, ...] = (), gate_up_layers: tuple[int, ...] = ()):
    """Tensors of a small MoE model: per layer attention + router + routed experts of the layer's
    type (a dense FFN on `dense_layers`, merged gate_up on `gate_up_layers`)."""
    t = [("token_embd.weight", Q.F16, (n_embd, 32))]
    for il in range(n_layer):
        t += [(f"blk.{il}.attn_norm.weight", Q.F32, (n_embd,)),
              (f"blk.{il}.attn_q.weight", Q.F16, (n_embd, n_embd)),
              (f"blk.{il}.ffn_norm.weight", Q.F32, (n_embd,))]
        if il in dense_layers:
            t += [(f"blk.{il}.ffn_{k}.weight", Q.F16, (n_embd, n_ff) if k != "down" else (n_ff, n_embd))
                  for k in ("gate", "up", "down")]
            continue
        qt = layer_types.get(il, Q.F16)
        t.append((f"blk.{il}.ffn_gate_inp.weight", Q.F32, (n_embd, n_expert)))
        if il in gate_up_layers:
            t.append((f"blk.{il}.ffn_gate_up_exps.weight", qt, (n_embd, 2 * n_ff, n_expert)))
        else:
            t.append((f"blk.{il}.ffn_gate_exps.weight", qt, (n_embd, n_ff, n_expert)))
            t.append((f"blk.{il}.ffn_up_exps.weight", qt, (n_embd, n_ff, n_expert)))
        t.append((f"blk.{il}.ffn_down_exps.weight", Q.Q8_0 if qt != Q.F16 else Q.F16, (n_ff, n_embd, n_expert)))
    t += [("output_norm.weight", Q.F32, (n_embd,)), ("output.weight", Q.Q8_0, (n_embd, 32))]
    return t


def _write_models(d: Path) -> dict[str, Path]:
    return {
        # F16 everywhere, default alignment
        "moe_f16": write_gguf(d / "moe_f16.gguf", "qwen3moe", 3, moe_tensors(3, 64, 32, 4, {}),
                              n_expert=4, top_k=2),
        # per-layer types (like Unsloth "UD" quants), a dense first layer, a merged gate_up layer,
        # and a non-default alignment
        "moe_mixed": write_gguf(d / "moe_mixed.gguf", "deepseek2", 4,
                                moe_tensors(4, 256, 64, 8, {1: Q.Q4_K, 2: Q.Q8_0, 3: Q.Q6_K},
                                            dense_layers=(0,), gate_up_layers=(3,)),
                                n_expert=8, top_k=3, alignment=64),
        # split into shards of 5 tensors: expert tensors of one layer land in different shards
        "moe_split": write_gguf(d / "moe_split.gguf", "qwen3moe", 3, moe_tensors(3, 64, 32, 4, {1: Q.Q8_0}),
                                n_expert=4, top_k=2, split_max_tensors=5),
    }


class _Models(dict):
    """Our models, written up front; the fixtures module's ("fixture:NAME"), written on first use.
    Those are quantized by llama.cpp, so they need LLAMA_CPP_LIB_PATH."""

    def __init__(self, d: Path):
        super().__init__(_write_models(d))
        self.dir = d

    def __missing__(self, name: str) -> Path:
        if not os.environ.get("LLAMA_CPP_LIB_PATH"):
            pytest.skip("the fixtures module's models need LLAMA_CPP_LIB_PATH (llama.cpp quantizes them)")
        self[name] = Path(write_fixture(name.removeprefix("fixture:"), self.dir / "fixtures"))
        return self[name]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return _Models(tmp_path_factory.mktemp("models"))


MODEL_NAMES = ["moe_f16", "moe_mixed", "moe_split"] + [f"fixture:{n}" for n in FIXTURES]


# --------------------------------------------------------------------------------------------
# llama.cpp's GGUF parser through ctypes


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


@pytest.fixture(scope="module")
def ggml() -> ctypes.CDLL:
    lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH")
    if not lib_dir:
        pytest.skip("set LLAMA_CPP_LIB_PATH to the directory of libggml-base.so to compare with llama.cpp")
    lib = ctypes.CDLL(str(Path(lib_dir) / "libggml-base.so"))
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GgufInitParams]
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    lib.gguf_get_data_offset.argtypes = [ctypes.c_void_p]
    lib.gguf_get_data_offset.restype = ctypes.c_size_t
    lib.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
    lib.gguf_get_n_tensors.restype = ctypes.c_int64
    lib.gguf_find_tensor.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.gguf_find_tensor.restype = ctypes.c_int64
    lib.gguf_get_tensor_name.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_tensor_name.restype = ctypes.c_char_p
    for fn in ("gguf_get_tensor_offset", "gguf_get_tensor_size"):
        getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_int64]
        getattr(lib, fn).restype = ctypes.c_size_t
    lib.gguf_get_tensor_type.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_tensor_type.restype = ctypes.c_int
    return lib


def _llama_cpp_tensors(lib: ctypes.CDLL, path: Path) -> dict[str, tuple[int, int, int]]:
    """name -> (absolute offset, size in bytes, ggml type id) as llama.cpp computes them."""
    ctx = lib.gguf_init_from_file(str(path).encode(), _GgufInitParams(True, None))
    assert ctx, f"llama.cpp's gguf_init_from_file rejected {path}"
    try:
        data_offset = lib.gguf_get_data_offset(ctx)
        out = {}
        for i in range(lib.gguf_get_n_tensors(ctx)):
            name = lib.gguf_get_tensor_name(ctx, i).decode()
            assert lib.gguf_find_tensor(ctx, name.encode()) == i
            out[name] = (data_offset + lib.gguf_get_tensor_offset(ctx, i), lib.gguf_get_tensor_size(ctx, i),
                         lib.gguf_get_tensor_type(ctx, i))
        return out
    finally:
        lib.gguf_free(ctx)


# --------------------------------------------------------------------------------------------
# Cross-checks


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_offsets_match_llama_cpp(models, ggml, name):
    index = load_index(models[name])
    assert index.is_moe
    by_shard = {s.index: _llama_cpp_tensors(ggml, s.path) for s in index.shards}
    n_checked = 0
    for t in index.expert_tensors():
        offset, size, type_id = by_shard[t.shard][t.name]
        assert t.offset == offset, t.name
        assert t.nbytes == t.n_expert * t.stride == size, t.name
        assert t.type_name == gguf.GGMLQuantizationType(type_id).name
        assert t.n_expert == index.n_expert
        n_checked += 1
    # every routed expert tensor llama.cpp sees is in the index
    llama_exps = {n for tensors in by_shard.values() for n in tensors if n.endswith("_exps.weight")}
    assert n_checked == len(llama_exps)
    # and the rest adds up to "everything else"
    total = sum(size for tensors in by_shard.values() for _, size, _ in tensors.values())
    assert index.expert_bytes_total + index.other_bytes_total == total


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_expert_bytes_match_reader(models, name):
    index = load_index(models[name])
    for shard in index.shards:
        reader = gguf.GGUFReader(shard.path)
        assert reader.data_offset == shard.data_offset
        by_name = {t.name: t for t in reader.tensors}
        with open(shard.path, "rb") as f:
            fd = f.fileno()
            for t in index.expert_tensors():
                if t.shard != shard.index:
                    continue
                rt = by_name[t.name]
                assert rt.data_offset == t.offset
                assert tuple(int(x) for x in rt.shape) == t.shape
                for e in range(t.n_expert):
                    path, offset, size = t.expert(e)
                    assert path == shard.path and size == t.stride
                    assert os.pread(fd, size, offset) == rt.data[e].tobytes(), (t.name, e)


def test_model_summary(models):
    index = load_index(models["moe_mixed"])
    assert (index.architecture, index.n_layer, index.n_expert, index.n_expert_used) == ("deepseek2", 4, 8, 3)
    assert index.moe_layers == [1, 2, 3]  # layer 0 is dense
    l1, l3 = index.layer(1), index.layer(3)
    assert list(l1.tensors) == ["gate", "up", "down"] and list(l3.tensors) == ["down", "gate_up"]
    assert l1.tensors["gate"].type_name == "Q4_K" and l1.tensors["down"].type_name == "Q8_0"
    # Q4_K: 144 bytes per 256 values; gate/up [256, 64] -> 64 rows of 144 bytes
    assert l1.tensors["gate"].stride == 144 * 64
    # Q8_0: 34 bytes per 32 values; down [64, 256] -> 256 rows of 2 * 34 bytes
    assert l1.tensors["down"].stride == 68 * 256
    assert l1.expert_bytes == 2 * 144 * 64 + 68 * 256
    assert index.cold_bytes_per_token == 3 * sum(layer.expert_bytes for layer in index.layers)
    # every tensor offset is aligned to general.alignment = 64
    assert all(t.offset % 64 == 0 for t in index.expert_tensors())
    with pytest.raises(IndexError):
        l1.tensors["up"].expert(8)
    with pytest.raises(KeyError):
        index.layer(0)
    json.dumps(index.to_dict())


def test_split_model(models):
    first = models["moe_split"]
    index = load_index(first)
    assert len(index.shards) > 2
    assert [s.path.name for s in index.shards] == [
        f"moe_split-{i + 1:05d}-of-{len(index.shards):05d}.gguf" for i in range(len(index.shards))]
    assert len({t.shard for t in index.expert_tensors()}) > 1  # experts spread over shards
    for t in index.expert_tensors():
        assert t.path == index.shards[t.shard].path
        names = {rt.name for rt in gguf.GGUFReader(t.path).tensors}
        assert t.name in names
    # any shard finds the whole set, and the same offsets
    other = load_index(index.shards[-1].path)
    assert other.path == index.path
    assert other.to_dict() == index.to_dict()


def test_split_model_missing_shard(models, tmp_path):
    index = load_index(models["moe_split"])
    for s in index.shards[:-1]:
        shutil.copy(s.path, tmp_path / s.path.name)
    with pytest.raises(ModelError, match="missing") as e:
        load_index(tmp_path / index.shards[0].path.name)
    assert e.value.path.name == index.shards[-1].path.name


# --------------------------------------------------------------------------------------------
# Bad inputs


def test_truncated_data(models, tmp_path):
    src = models["moe_f16"]
    cut = tmp_path / "cut.gguf"
    data = src.read_bytes()
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelError, match="truncated") as e:
        load_index(cut)
    assert e.value.path == cut
    assert e.value.tensor is not None and e.value.tensor in str(e.value)


def test_truncated_header(models, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(models["moe_f16"].read_bytes()[:200])
    with pytest.raises(ModelError, match="truncated"):
        load_index(cut)


def test_not_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelError, match="not a GGUF"):
        load_index(p)
    p.write_bytes(b"")
    with pytest.raises(ModelError, match="not a GGUF"):
        load_index(p)
    with pytest.raises(ModelError, match="cannot open"):
        load_index(tmp_path / "nope.gguf")


def test_dense_model_has_no_moe_layers(tmp_path):
    tensors = [("token_embd.weight", Q.F16, (64, 32))]
    for il in range(2):
        tensors += [(f"blk.{il}.attn_q.weight", Q.F16, (64, 64)),
                    (f"blk.{il}.ffn_gate.weight", Q.Q8_0, (64, 128)),
                    (f"blk.{il}.ffn_up.weight", Q.Q8_0, (64, 128)),
                    (f"blk.{il}.ffn_down.weight", Q.F16, (128, 64))]
    index = load_index(write_gguf(tmp_path / "dense.gguf", "llama", 2, tensors))
    assert not index.is_moe and index.layers == [] and index.moe_layers == []
    assert (index.architecture, index.n_layer, index.n_expert, index.n_expert_used) == ("llama", 2, 0, 0)
    assert index.cold_bytes_per_token == 0 and index.expert_bytes_total == 0
    assert index.other_bytes_total == 64 * 32 * 2 + 2 * (64 * 64 * 2 + 2 * 128 * 2 * 34 + 128 * 64 * 2)


def _moe_with(tmp_path, replace: dict[str, tuple[Q, tuple[int, ...]] | None], extra=(), n_expert=4, top_k=2):
    """A 2-layer MoE model with some tensors replaced (or dropped, for None)."""
    tensors = []
    for name, qt, shape in moe_tensors(2, 64, 32, 4, {}):
        if name in replace:
            if replace[name] is None:
                continue
            qt, shape = replace[name]
        tensors.append((name, qt, shape))
    return write_gguf(tmp_path / "bad.gguf", "qwen3moe", 2, tensors + list(extra), n_expert=n_expert, top_k=top_k)


@pytest.mark.parametrize("replace, match, tensor", [
    # down must be [n_ff, n_embd]: here it is [n_embd, n_ff]
    ({"blk.1.ffn_down_exps.weight": (Q.F16, (64, 32, 4))}, "should be", "blk.1.ffn_gate_exps.weight"),
    # up with another n_ff than gate
    ({"blk.0.ffn_up_exps.weight": (Q.F16, (64, 64, 4))}, "should be", "blk.0.ffn_up_exps.weight"),
    # ne2 != expert_count
    ({"blk.1.ffn_up_exps.weight": (Q.F16, (64, 32, 5))}, "expert_count is 4", "blk.1.ffn_up_exps.weight"),
    # 2-D expert tensor
    ({"blk.0.ffn_gate_exps.weight": (Q.F16, (64, 128))}, "must be 3-D", "blk.0.ffn_gate_exps.weight"),
    # no down
    ({"blk.1.ffn_down_exps.weight": None}, "no blk.1.ffn_down_exps", "blk.1.ffn_gate_exps.weight"),
])
def test_inconsistent_experts(tmp_path, replace, match, tensor):
    with pytest.raises(ModelError, match=match) as e:
        load_index(_moe_with(tmp_path, replace))
    assert e.value.tensor == tensor
    assert "re-convert" in str(e.value)


def test_expert_count_mismatch(tmp_path):
    with pytest.raises(ModelError, match="expert_count is 8"):
        load_index(_moe_with(tmp_path, {}, n_expert=8))
    with pytest.raises(ModelError, match="expert_used_count is 0"):
        load_index(_moe_with(tmp_path, {}, top_k=0))


def test_old_per_expert_layout(tmp_path):
    old = [(f"blk.0.ffn_{k}.{e}.weight", Q.F16, (64, 32) if k != "down" else (32, 64))
           for e in range(4) for k in ("gate", "up", "down")]
    tensors = [("token_embd.weight", Q.F16, (64, 32)), ("blk.0.ffn_gate_inp.weight", Q.F32, (64, 4))] + old
    path = write_gguf(tmp_path / "old.gguf", "llama", 1, tensors, n_expert=4, top_k=2)
    with pytest.raises(ModelError, match="old one-tensor-per-expert layout") as e:
        load_index(path)
    assert e.value.tensor == "blk.0.ffn_gate.0.weight"


# --------------------------------------------------------------------------------------------
# empanel-gguf inspect


def test_inspect_table(models, capsys):
    assert inspect_cmd.main([str(models["moe_mixed"])]) == 0
    out = capsys.readouterr().out
    index = load_index(models["moe_mixed"])
    assert "deepseek2" in out and "top-k 3" in out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    for row, layer in zip(rows, index.layers):
        assert row[1] == ",".join(layer.tensors) and int(row[3]) == layer.expert_bytes
        for t in layer.tensors.values():
            assert f"{t.kind}={t.offset}" in row


def test_inspect_split_table(models, capsys):
    assert inspect_cmd.main([str(models["moe_split"])]) == 0
    out = capsys.readouterr().out
    index = load_index(models["moe_split"])
    for t in index.expert_tensors():
        assert f"{t.kind}={t.offset}@{t.shard}" in out


def test_inspect_json(models, capsys):
    assert inspect_cmd.main([str(models["moe_f16"]), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    index = load_index(models["moe_f16"])
    assert d["architecture"] == "qwen3moe" and d["n_expert"] == 4 and d["moe_layers"] == [0, 1, 2]
    assert d["cold_bytes_per_token"] == index.cold_bytes_per_token
    for layer in d["layers"]:
        for kind, t in layer["tensors"].items():
            assert t["offset"] == index.layer(layer["layer"]).tensors[kind].offset
            assert t["stride"] == index.layer(layer["layer"]).tensors[kind].stride


def test_inspect_dense(tmp_path, capsys):
    path = write_gguf(tmp_path / "dense.gguf", "llama", 1, [("token_embd.weight", Q.F16, (64, 32))])
    assert inspect_cmd.main([str(path)]) == 0
    assert "not a MoE model" in capsys.readouterr().out


def test_inspect_error(tmp_path, capsys):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"not a model")
    assert inspect_cmd.main([str(p)]) == 1
    captured = capsys.readouterr()
    assert "not a GGUF" in captured.err and str(p) in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_no_tensors(tmp_path, ggml):
    """A GGUF with metadata only: llama.cpp does not pad the data offset then; neither do we."""
    path = write_gguf(tmp_path / "empty.gguf", "llama", 0, [])
    index = load_index(path)
    assert not index.is_moe and index.other_bytes_total == 0
    ctx = ggml.gguf_init_from_file(str(path).encode(), _GgufInitParams(True, None))
    assert ctx
    try:
        assert index.shards[0].data_offset == ggml.gguf_get_data_offset(ctx)
    finally:
        ggml.gguf_free(ctx)


def test_mtp_block_is_left_out_unless_loaded(tmp_path):
    """Issue 36: the last nextn_predict_layers blocks are MTP blocks, which llama.cpp creates
    only with load_mtp on an architecture whose loader has them: otherwise no layer, no pool,
    no bytes in any total (inspect, estimate, cold bytes per token)."""
    tensors = moe_tensors(3, 64, 32, 4, {})
    tensors += [("blk.2.nextn.eh_proj.weight", Q.F16, (128, 64)), ("blk.2.nextn.enorm.weight", Q.F32, (64,))]
    path = write_gguf(tmp_path / "mtp.gguf", "glm4moe", 3, tensors, n_expert=4, top_k=2,
                      uint32_kv={"glm4moe.nextn_predict_layers": 1})
    full = load_index(write_gguf(tmp_path / "full.gguf", "glm4moe", 3, tensors, n_expert=4, top_k=2))
    index = load_index(path)
    assert index.moe_layers == [0, 1] and index.mtp_layers == [2] and not index.mtp_loaded
    assert [layer.layer for layer in index.mtp_skipped] == [2]
    mtp_experts = full.layer(2).expert_bytes * 4
    assert index.expert_bytes_total == full.expert_bytes_total - mtp_experts
    assert index.expert_bytes_total + index.other_bytes_total + index.mtp_skipped_bytes == \
        full.expert_bytes_total + full.other_bytes_total
    assert index.cold_bytes_per_token == full.cold_bytes_per_token * 2 // 3
    assert index.to_dict()["mtp"] == {"layers": [2], "loaded": False, "skipped_moe_layers": [2],
                                      "skipped_bytes": index.mtp_skipped_bytes}

    loaded = load_index(path, mtp=True)  # as --spec-type draft-mtp loads it: paged like the others
    assert loaded.moe_layers == [0, 1, 2] and loaded.mtp_loaded and loaded.mtp_skipped == []
    assert loaded.expert_bytes_total == full.expert_bytes_total

    # an architecture whose loader never creates the block skips it even with load_mtp
    other = write_gguf(tmp_path / "q.gguf", "qwen3moe", 3, tensors, n_expert=4, top_k=2,
                       uint32_kv={"qwen3moe.nextn_predict_layers": 1})
    assert load_index(other, mtp=True).moe_layers == [0, 1]

    # deepseek4's loader takes the block for trunk unless its nextn.eh_proj is in the file
    trunk = [t for t in tensors if not t[0].startswith("blk.2.nextn.")]
    for name, body, moe_layers in (("ds4-trunk", trunk, [0, 1, 2]), ("ds4-mtp", tensors, [0, 1])):
        ds4 = write_gguf(tmp_path / f"{name}.gguf", "deepseek4", 3, body, n_expert=4, top_k=2,
                         uint32_kv={"deepseek4.nextn_predict_layers": 1})
        assert load_index(ds4).moe_layers == moe_layers, name

    bad = write_gguf(tmp_path / "bad.gguf", "glm4moe", 3, tensors, n_expert=4, top_k=2,
                     uint32_kv={"glm4moe.nextn_predict_layers": 4})
    with pytest.raises(ModelError, match="nextn_predict_layers is 4 with 3 blocks"):
        load_index(bad)
