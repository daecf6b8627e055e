"""Where every routed expert lives in a GGUF model (one file or a split set).

`load_index(path)` reads only the GGUF headers (never the tensor data) and returns a
`ModelIndex`: for each routed expert tensor `blk.N.ffn_{gate,up,down,gate_up}_exps.weight`
its ggml type, shape, shard, the absolute file offset of expert 0 and the expert stride, so
that expert e is the byte range [offset + e * stride, offset + (e + 1) * stride) of one file.

The offsets are the ones llama.cpp uses (llama-model-loader.h, `llama_tensor_weight`):
    offs = gguf_get_data_offset(shard) + gguf_get_tensor_offset(shard, tensor)
A ggml tensor of shape [ne0, ne1, ne2] (ne0 innermost) is contiguous with
    nb1 = row_size(type, ne0) = ne0 / block_size * type_size      bytes per row
    nb2 = nb1 * ne1                                                bytes per expert
so one expert of a routed tensor [ne0, ne1, n_expert] is one contiguous slice of nb2 bytes.

The header parser is our own (small, reads with plain file reads, so a truncated or foreign
file gives a clear `ModelError`); the gguf package supplies the type tables and key names.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType, Keys

from ..abi.header import READ_ALIGN

KINDS = ("gate", "up", "down", "gate_up")

# blk.N.ffn_{gate,up,down,gate_up}_exps.weight: routed experts, 3-D, expert outermost.
_EXPS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.weight$")
# blk.N.ffn_{gate,up,down}.E.weight: the pre-2024 one-tensor-per-expert layout.
_OLD_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")

# architectures whose llama.cpp loader creates the MTP ("nextn") blocks when the load asks for
# them (llama_model_params.load_mtp, set by --spec-type draft-mtp): the MoE ones of the pinned
# tree's src/models/*.cpp that test ml.load_mtp. Without load_mtp every architecture skips them
# ("model has unused tensor blk.N...") and so does dots3note always (no MTP graph yet).
MTP_ARCHS = frozenset({"bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4", "glm-dsa", "glm4moe",
                       "glm5-next", "hy_v3", "mimo2", "nemotron_h_moe", "qwen35moe", "qwen3next", "step35"})

# architectures whose loader counts the MTP blocks only when the first one's eh_proj is in the
# file (deepseek4.cpp: else nextn_predict_layers is taken as 0 and every block is trunk)
_MTP_PROBED_ARCHS = frozenset({"deepseek4"})

_GGML_MAX_DIMS = 4
MAX_LAYERS = 1 << 16  # the most layers a plan may name (csrc/plan_file.c's shape record)
_KNOWN_TYPES = {int(t) for t in GGML_QUANT_SIZES}

# struct formats (little-endian) of the fixed-size GGUF value types.
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}


class ModelError(ValueError):
    """A model file that cannot be used; the message names the file (and tensor) and a remedy."""

    def __init__(self, path: os.PathLike | str, problem: str, tensor: str | None = None):
        self.path = Path(path)
        self.tensor = tensor
        where = f"{self.path}" + (f": tensor '{tensor}'" if tensor else "")
        super().__init__(f"{where}: {problem}")


def row_size(type_id: int, ne0: int) -> int:
    """Bytes of one row of `ne0` elements of ggml type `type_id` (ggml_row_size)."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    return ne0 // block_size * type_size


def align_up(n: int, alignment: int) -> int:
    """n rounded up to a multiple of alignment (GGUF pads the header and every tensor's data so)."""
    return -(-n // alignment) * alignment


def type_name(type_id: int) -> str:
    return GGMLQuantizationType(type_id).name


# --------------------------------------------------------------------------------------------
# GGUF header parsing


@dataclass
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (innermost, contiguous) first
    type_id: int
    rel_offset: int  # bytes from the start of the shard's data section
    nbytes: int  # row_size(type, ne0) * ne1 * ne2 * ne3


@dataclass
class _Header:
    path: Path
    file_size: int  # bytes
    metadata: dict  # key -> value; arrays are kept only as their length (int)
    tensors: list[_TensorInfo]
    alignment: int
    data_offset: int  # absolute file offset of the data section
    info_offset: int = 0  # file offset of the first tensor info (the metadata ends there)


class _Reader:
    """Sequential reads from a file that turn a short read into a ModelError."""

    def __init__(self, f, path: Path, file_size: int):
        self.f, self.path, self.file_size, self.pos = f, path, file_size, 0

    def take(self, n: int, what: str) -> bytes:
        if n > self.file_size - self.pos:
            raise ModelError(self.path, f"file ends inside the GGUF header (reading {what} at byte {self.pos}, "
                             f"file is {self.file_size} bytes): it is truncated or not a GGUF; "
                             "download or copy it again")
        data = self.f.read(n)
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        if n > self.file_size - self.pos:
            self.take(n, what)  # raises: past the end of the file
        self.f.seek(n, os.SEEK_CUR)
        self.pos += n

    def scalar(self, vtype: int, what: str):
        fmt = _SCALAR_FORMATS[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        return self.take(n, what).decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str):
        """One metadata value; an array is skipped and returned as its length."""
        if vtype == GGUFValueType.STRING:
            return self.string(f"value of '{key}'")
        if vtype in _SCALAR_FORMATS:
            return self.scalar(vtype, f"value of '{key}'")
        if vtype == GGUFValueType.ARRAY:
            item_type = self.u32(f"array type of '{key}'")
            n = self.u64(f"array length of '{key}'")
            if item_type in _SCALAR_FORMATS:  # fixed size items: skip them in one seek
                self.skip(n * struct.calcsize(_SCALAR_FORMATS[item_type]), f"array '{key}'")
            else:
                for _ in range(n):
                    self.value(item_type, key)
            return n
        raise ModelError(self.path, f"metadata key '{key}' has unknown GGUF value type {vtype}: "
                         "the file is corrupt or from a newer GGUF version")


def _read_header(path: Path) -> _Header:
    try:
        file_size = path.stat().st_size
        f = open(path, "rb")
    except OSError as e:
        raise ModelError(path, f"cannot open: {e.strerror}") from None
    with f:
        r = _Reader(f, path, file_size)
        if file_size < 4 or struct.unpack("<I", f.read(4))[0] != GGUF_MAGIC:
            raise ModelError(path, "not a GGUF file (no 'GGUF' magic at byte 0); give the path of a .gguf model")
        r.pos = 4
        version = r.u32("version")
        if version not in (2, 3):
            raise ModelError(path, f"unsupported GGUF version {version} (big-endian or too old/new); "
                             "re-convert the model with a current llama.cpp")
        n_tensors = r.u64("tensor count")
        n_kv = r.u64("metadata count")

        metadata: dict = {}
        for _ in range(n_kv):
            key = r.string("metadata key")
            metadata[key] = r.value(r.u32(f"type of '{key}'"), key)
        info_offset = r.pos

        tensors: list[_TensorInfo] = []
        for _ in range(n_tensors):
            name = r.string("tensor name")
            n_dims = r.u32(f"dimension count of '{name}'")
            if n_dims > _GGML_MAX_DIMS:
                raise ModelError(path, f"has {n_dims} dimensions (ggml allows {_GGML_MAX_DIMS}); the file is corrupt",
                                 name)
            shape = tuple(r.scalar(GGUFValueType.INT64, f"shape of '{name}'") for _ in range(n_dims))
            type_id = r.u32(f"type of '{name}'")
            rel_offset = r.u64(f"offset of '{name}'")
            if type_id not in _KNOWN_TYPES:
                raise ModelError(path, f"has unknown ggml type {type_id}; update the gguf package or re-convert",
                                 name)
            block_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)][0]
            if any(ne < 0 for ne in shape) or (shape and shape[0] % block_size):
                raise ModelError(path, f"has an invalid shape {list(shape)} for type {type_name(type_id)}", name)
            n_rows = 1
            for ne in shape[1:]:
                n_rows *= ne
            nbytes = row_size(type_id, shape[0] if shape else 1) * n_rows
            tensors.append(_TensorInfo(name, shape, type_id, rel_offset, nbytes))

    alignment = metadata.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelError(path, f"general.alignment = {alignment!r} is not a power of two; the file is corrupt")
    # The data section starts at the next multiple of the alignment after the header (llama.cpp
    # pads only when there are tensors).
    data_offset = align_up(r.pos, alignment) if tensors else r.pos

    # llama.cpp's gguf reader insists that tensors are packed in order, each padded to the
    # alignment; and the loader that each tensor's data lies inside the file.
    expected = 0
    for t in tensors:
        if t.rel_offset != expected:
            raise ModelError(path, f"data offset {t.rel_offset} is not the expected {expected} "
                             "(llama.cpp would reject this file); re-convert the model", t.name)
        if data_offset + t.rel_offset + t.nbytes > file_size:
            raise ModelError(path, f"data ends at byte {data_offset + t.rel_offset + t.nbytes} but the file has "
                             f"only {file_size} bytes: the file is truncated; download or copy it again", t.name)
        expected += align_up(t.nbytes, alignment)
    return _Header(path, file_size, metadata, tensors, alignment, data_offset, info_offset)


# --------------------------------------------------------------------------------------------
# The index


@dataclass
class Shard:
    index: int  # 0-based, as split.no
    path: Path
    file_size: int  # bytes
    data_offset: int  # absolute file offset of the data section
    n_tensors: int


@dataclass
class ExpertTensor:
    """One routed expert tensor [ne0, ne1, n_expert]; expert e = bytes [offset + e*stride, +stride)."""

    name: str
    layer: int
    kind: str  # gate | up | down | gate_up
    type_name: str  # ggml type, e.g. "Q4_K"
    shape: tuple[int, int, int]  # (ne0, ne1, n_expert), ggml order
    shard: int  # index into ModelIndex.shards
    path: Path  # file holding the tensor
    offset: int  # absolute file offset of expert 0 (data offset + tensor offset)
    stride: int  # nb2: bytes of one expert = row_size(type, ne0) * ne1

    @property
    def n_expert(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return self.stride * self.shape[2]

    @property
    def lands_in_place(self) -> bool:
        """Reads of its experts land in a plain pool's slots with no copy (csrc/reader.c): every
        expert sits at one offset modulo the O_DIRECT block, i.e. the stride is a multiple of it."""
        return self.stride % READ_ALIGN == 0

    def expert(self, e: int) -> tuple[Path, int, int]:
        """(path, absolute offset, size in bytes) of expert e's slice of this tensor."""
        if not 0 <= e < self.shape[2]:
            raise IndexError(f"expert {e} out of range 0..{self.shape[2] - 1} for {self.name}")
        return self.path, self.offset + e * self.stride, self.stride

    def to_dict(self) -> dict:
        return {"name": self.name, "layer": self.layer, "kind": self.kind, "type": self.type_name,
                "shape": list(self.shape), "shard": self.shard, "path": str(self.path),
                "offset": self.offset, "stride": self.stride}


@dataclass
class MoeLayer:
    layer: int
    tensors: dict[str, ExpertTensor]  # kind -> tensor, in KINDS order

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert over all of this layer's routed tensors (one miss reads this)."""
        return sum(t.stride for t in self.tensors.values())

    def to_dict(self) -> dict:
        return {"layer": self.layer, "expert_bytes": self.expert_bytes,
                "tensors": {kind: t.to_dict() for kind, t in self.tensors.items()}}


@dataclass
class ModelIndex:
    path: Path  # first shard (the path llama.cpp must be given)
    shards: list[Shard]
    architecture: str
    n_layer: int  # <arch>.block_count
    n_expert: int  # <arch>.expert_count, 0 if absent
    n_expert_used: int  # <arch>.expert_used_count (top-k), 0 if absent
    layers: list[MoeLayer] = field(default_factory=list)  # MoE layers only, ascending
    expert_bytes_total: int = 0  # bytes of all routed expert tensors
    other_bytes_total: int = 0  # bytes of every other tensor (resident weights)
    # the first shard's metadata as the header reader keeps it (arrays as their length), so that
    # the estimate (estimate.model_shape) does not read the header a second time
    metadata: dict = field(default_factory=dict, repr=False, compare=False)
    # MTP ("nextn") blocks: the last n_layer_nextn of the n_layer blocks (<arch>.nextn_predict_layers)
    n_layer_nextn: int = 0
    mtp_loaded: bool = False  # llama.cpp creates their tensors (load_mtp, an MTP_ARCHS loader)
    mtp_skipped: list = field(default_factory=list)  # MoeLayers of MTP blocks llama.cpp skips: no pool
    mtp_skipped_bytes: int = 0  # bytes of every tensor of the skipped MTP blocks (never loaded)

    @property
    def mtp_layers(self) -> list[int]:
        """Layer ids of the MTP blocks (loaded or not)."""
        return list(range(self.n_layer - self.n_layer_nextn, self.n_layer))

    @property
    def moe_layers(self) -> list[int]:
        return [layer.layer for layer in self.layers]

    @property
    def is_moe(self) -> bool:
        return bool(self.layers)

    @property
    def cold_bytes_per_token(self) -> int:
        """Bytes a token reads at 0 % cache hits: top-k experts on every MoE layer."""
        return sum(self.n_expert_used * layer.expert_bytes for layer in self.layers)

    def layer(self, il: int) -> MoeLayer:
        for layer in self.layers:
            if layer.layer == il:
                return layer
        raise KeyError(f"layer {il} is not a MoE layer of {self.path}")

    def expert_tensors(self) -> list[ExpertTensor]:
        return [t for layer in self.layers for t in layer.tensors.values()]

    def to_dict(self) -> dict:
        return {
            "path": str(self.path),
            "architecture": self.architecture,
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "moe_layers": self.moe_layers,
            "shards": [{"index": s.index, "path": str(s.path), "file_size": s.file_size,
                        "data_offset": s.data_offset, "n_tensors": s.n_tensors} for s in self.shards],
            "expert_bytes_total": self.expert_bytes_total,
            "other_bytes_total": self.other_bytes_total,
            "cold_bytes_per_token": self.cold_bytes_per_token,
            "layers": [layer.to_dict() for layer in self.layers],
            "mtp": {"layers": self.mtp_layers, "loaded": self.mtp_loaded,
                    "skipped_moe_layers": [layer.layer for layer in self.mtp_skipped],
                    "skipped_bytes": self.mtp_skipped_bytes},
        }


def _shard_paths(path: Path, header: _Header) -> list[Path]:
    """All shard paths of a split model (`<prefix>-00001-of-0000N.gguf`), or [path]."""
    count = header.metadata.get(Keys.Split.LLM_KV_SPLIT_COUNT, 0)
    if not isinstance(count, int) or count <= 1:
        return [path]
    no = header.metadata.get(Keys.Split.LLM_KV_SPLIT_NO)
    if not isinstance(no, int) or not 0 <= no < count:
        raise ModelError(path, f"split.count is {count} but split.no is {no!r}; the shard is corrupt")
    suffix = f"-{no + 1:05d}-of-{count:05d}.gguf"
    if not path.name.endswith(suffix) or len(path.name) == len(suffix):
        raise ModelError(path, f"is shard {no + 1} of {count} but its name does not end in '{suffix}'; "
                         "rename the shards to llama.cpp's <prefix>-NNNNN-of-NNNNN.gguf")
    prefix = path.name[: -len(suffix)]
    return [path.with_name(f"{prefix}-{i + 1:05d}-of-{count:05d}.gguf") for i in range(count)]


def _get_int(header: _Header, key: str, default: int) -> int:
    value = header.metadata.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelError(header.path, f"metadata '{key}' is {value!r}, not an integer; the file is corrupt")
    return value


def adapter_expert_tensors(path: os.PathLike | str) -> list[str]:
    """The routed-expert weights (blk.N.ffn_*_exps.weight) that a LoRA adapter file changes."""
    names = set()
    for t in _read_header(Path(path)).tensors:
        base = t.name.rsplit(".", 1)[0] if t.name.endswith((".lora_a", ".lora_b")) else t.name
        if _EXPS_RE.match(base):
            names.add(base)
    return sorted(names)


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def load_index(path: os.PathLike | str, mtp: bool = False) -> ModelIndex:
    """Index the routed experts of a GGUF model; `path` may be any shard of a split model.

    mtp: whether the load asks llama.cpp for the MTP blocks (load_mtp). The routed experts of MTP
    blocks that llama.cpp will not create (mtp False, or an architecture whose loader never does)
    are left out of `layers` and of every total, as the load leaves them in the file: no pool, no
    bytes; `mtp_skipped` lists them."""
    headers = _read_shards(Path(path))
    first = headers[0]  # llama.cpp reads the model's metadata from the first shard only
    shape = _block_shape(first, headers, mtp)
    found = _expert_tensors(headers, shape)
    split_tensors = first.metadata.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    if len(headers) > 1 and split_tensors is not None and split_tensors != found.n_tensors:
        raise ModelError(first.path, f"split.tensors.count is {split_tensors} but the {len(headers)} shards hold "
                         f"{found.n_tensors} tensors; some shard is from another model")

    checked = [_check_layer(first.path, il, found.by_layer[il]) for il in sorted(found.by_layer)]
    if checked and not 0 < shape.n_expert_used <= shape.n_expert:
        raise ModelError(first.path, f"{shape.arch}.expert_used_count is {shape.n_expert_used} with "
                         f"{shape.n_expert} experts; the model is inconsistent, re-convert it")
    return ModelIndex(first.path, found.shards, shape.arch, shape.n_layer, shape.n_expert, shape.n_expert_used,
                      [layer for layer in checked if layer.layer < shape.first_mtp], found.expert_bytes,
                      found.other_bytes, first.metadata, n_layer_nextn=shape.n_layer_nextn,
                      mtp_loaded=shape.mtp_loaded,
                      mtp_skipped=[layer for layer in checked if layer.layer >= shape.first_mtp],
                      mtp_skipped_bytes=found.skipped_bytes)


def _read_shards(path: Path) -> list:
    """The headers of every shard of the model `path` belongs to, in order; ModelError for a
    missing shard or shards that do not belong together."""
    header = _read_header(path)
    paths = _shard_paths(path, header)
    headers = []
    for i, p in enumerate(paths):
        if p != path and not p.exists():
            raise ModelError(p, f"shard {i + 1} of {len(paths)} is missing; put all shards in one directory")
        h = header if p == path else _read_header(p)
        if len(paths) > 1 and h.metadata.get(Keys.Split.LLM_KV_SPLIT_NO) != i:
            raise ModelError(p, f"split.no is {h.metadata.get(Keys.Split.LLM_KV_SPLIT_NO)!r}, expected {i}; "
                             "the shards do not belong together")
        headers.append(h)
    return headers


@dataclass
class _BlockShape:
    """What the first shard's metadata says of the blocks and experts."""
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_layer_nextn: int   # MTP ("nextn") blocks at the end
    mtp_loaded: bool     # whether llama.cpp creates them for this load
    first_mtp: int       # blocks from here on are skipped (n_layer where the MTP blocks load)


def _block_shape(first, headers, mtp) -> _BlockShape:
    arch = first.metadata.get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise ModelError(first.path, "has no general.architecture; it is not a llama.cpp model")
    n_layer = _get_int(first, Keys.LLM.BLOCK_COUNT.format(arch=arch), 0)
    if not 0 <= n_layer <= MAX_LAYERS:
        raise ModelError(first.path, f"{arch}.block_count is {n_layer} (at most {MAX_LAYERS} layers are "
                         "plausible); the file is corrupt")
    n_expert = _get_int(first, Keys.LLM.EXPERT_COUNT.format(arch=arch), 0)
    n_expert_used = _get_int(first, Keys.LLM.EXPERT_USED_COUNT.format(arch=arch), 0)
    n_layer_nextn = _get_int(first, f"{arch}.nextn_predict_layers", 0)
    if not 0 <= n_layer_nextn <= n_layer:
        raise ModelError(first.path, f"{arch}.nextn_predict_layers is {n_layer_nextn} with {n_layer} blocks; "
                         "the file is corrupt")
    if n_layer_nextn and arch in _MTP_PROBED_ARCHS and not any(
            t.name == f"blk.{n_layer - n_layer_nextn}.nextn.eh_proj.weight" for h in headers for t in h.tensors):
        n_layer_nextn = 0
    mtp_loaded = n_layer_nextn > 0 and mtp and arch in MTP_ARCHS
    return _BlockShape(arch, n_layer, n_expert, n_expert_used, n_layer_nextn, mtp_loaded,
                       first_mtp=n_layer if mtp_loaded else n_layer - n_layer_nextn)


@dataclass
class _Tensors:
    """The shards' tensors, sorted: the routed experts by layer and kind, and bytes (of the blocks
    the load creates) of experts and of everything else."""
    shards: list = field(default_factory=list)
    by_layer: dict = field(default_factory=dict)  # {layer: {kind: ExpertTensor}}
    n_tensors: int = 0
    expert_bytes: int = 0
    other_bytes: int = 0
    skipped_bytes: int = 0  # of the MTP blocks llama.cpp skips


def _expert_tensors(headers, shape: _BlockShape) -> _Tensors:
    arch, n_expert = shape.arch, shape.n_expert
    found = _Tensors()
    seen: set[str] = set()
    for i, h in enumerate(headers):
        found.shards.append(Shard(i, h.path, h.file_size, h.data_offset, len(h.tensors)))
        for t in h.tensors:
            if t.name in seen:
                raise ModelError(h.path, "appears twice in the model; the shards do not belong together", t.name)
            seen.add(t.name)
            if _OLD_EXPERT_RE.match(t.name):
                raise ModelError(h.path, "uses the old one-tensor-per-expert layout, which llama.cpp no longer "
                                 "loads; re-convert the model with a current convert_hf_to_gguf.py", t.name)
            block = _BLOCK_RE.match(t.name)
            skipped = block is not None and int(block.group(1)) >= shape.first_mtp  # an MTP block llama.cpp skips
            found.skipped_bytes += t.nbytes if skipped else 0
            m = _EXPS_RE.match(t.name)
            if not m:
                found.other_bytes += 0 if skipped else t.nbytes
                continue
            layer, kind = int(m.group(1)), m.group(2)
            dims = t.shape + (1,) * (_GGML_MAX_DIMS - len(t.shape))  # pad to 4 dims, as ggml does
            if len(t.shape) < 3 or dims[3] != 1:
                raise ModelError(h.path, f"has shape {list(t.shape)}; a routed expert tensor must be 3-D "
                                 "[ne0, ne1, n_expert]; re-convert the model", t.name)
            if dims[2] != n_expert:
                raise ModelError(h.path, f"holds {dims[2]} experts but {arch}.expert_count is {n_expert}; "
                                 "the model is inconsistent, re-convert it", t.name)
            if not 0 <= layer < shape.n_layer:
                raise ModelError(h.path, f"is on layer {layer} but {arch}.block_count is {shape.n_layer}", t.name)
            found.expert_bytes += 0 if skipped else t.nbytes
            found.by_layer.setdefault(layer, {})[kind] = ExpertTensor(
                name=t.name, layer=layer, kind=kind, type_name=type_name(t.type_id),
                shape=(dims[0], dims[1], dims[2]), shard=i, path=h.path,
                offset=h.data_offset + t.rel_offset,
                stride=row_size(t.type_id, dims[0]) * dims[1])
    found.n_tensors = len(seen)
    return found


def _check_layer(path: Path, il: int, tensors: dict[str, ExpertTensor]) -> MoeLayer:
    """Check that one layer's expert tensors form an FFN: gate/up [n_embd, n_ff], down [n_ff, n_embd],
    gate_up [n_embd, 2*n_ff]."""
    def bad(name: str, problem: str) -> ModelError:
        return ModelError(path, f"{problem}; the model is inconsistent, re-convert it", name)

    down = tensors.get("down")
    if down is None:
        any_t = next(iter(tensors.values()))
        raise bad(any_t.name, f"layer {il} has routed experts but no blk.{il}.ffn_down_exps.weight")
    if "up" not in tensors and "gate_up" not in tensors:
        raise bad(down.name, f"layer {il} has no blk.{il}.ffn_up_exps.weight nor ffn_gate_up_exps.weight")
    if "gate_up" in tensors and ("gate" in tensors or "up" in tensors):
        raise bad(tensors["gate_up"].name, f"layer {il} has both a merged gate_up and separate gate/up experts")
    n_ff, n_embd = down.shape[0], down.shape[1]
    for kind, t in tensors.items():
        want = {"gate": (n_embd, n_ff), "up": (n_embd, n_ff), "gate_up": (n_embd, 2 * n_ff)}.get(kind)
        if want is not None and t.shape[:2] != want:
            raise bad(t.name, f"has shape {list(t.shape[:2])} but {down.name} is {[n_ff, n_embd]} "
                      f"(so {kind} should be {list(want)})")
    return MoeLayer(il, {k: tensors[k] for k in KINDS if k in tensors})
