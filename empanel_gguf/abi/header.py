"""What csrc/empanel.h declares, read as data: the counters of a paged layer, the eviction
policies, the read paths, the pool's defaults and bounds, and the versions.

Both are declared once, as X-macro lists in the header (EMPANEL_LAYER_COUNTERS, EMPANEL_POLICIES):
the C structs and enums, the programs' stats file and /metrics (csrc/load.c), the cffi
declarations (native.py) and the Python names all come from them. This module reads the header
that came with the libraries (the source tree's in a checkout); it loads no library, so planning
can use it.

    COUNTERS          Counter(field, kind, metric, help) per counter, in the struct's order
    ENGINE_POLICIES   the engine's eviction policies by name, in enum order
    SIDECAR_VERSION   EMPANEL_SIDECAR_VERSION: the library must report the same
    API_VERSION       LLAMA_EMPANEL_API_VERSION of llama-empanel-shared.h (the hook header both
                      libraries share): libllama must report the same
    READ_ALIGN        LLAMA_EMPANEL_READ_ALIGN there: the O_DIRECT block of the reads, bytes
    DEFINES           {name: int} of every numeric #define EMPANEL_*: the pool's defaults and
                      bounds (EMPANEL_DEFAULT_READ_THREADS, EMPANEL_MAX_QUEUE_DEPTH, ...),
                      EMPANEL_PLAN_VERSION
    READ_IO           {"auto": 0, "threads": 1, "uring": 2}: enum empanel_read_io by name
    policy_id(name)   enum empanel_policy of a name; ValueError if unknown
"""

import os
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # empanel_gguf/, which holds lib/
SOURCE_HEADER = PACKAGE_DIR.parent / "csrc" / "empanel.h"
SOURCE_SHARED_HEADER = PACKAGE_DIR.parent / "patches" / "files" / "include" / "llama-empanel-shared.h"


@dataclass(frozen=True)
class Counter:
    field: str    # member of struct empanel_layer_stats (uint64_t); *_ns in nanoseconds
    kind: str     # "counter" or "gauge" (Prometheus types)
    metric: str   # Prometheus series without the empanel_ prefix, "" for none
    help: str

    @property
    def name(self):
        """The name Python reports: *_ns fields as *_s, in seconds."""
        return self.field[:-3] + "_s" if self.field.endswith("_ns") else self.field

    def value(self, raw):
        """The reported value of a raw count (seconds for *_ns)."""
        return raw / 1e9 if self.field.endswith("_ns") else raw


def lib_dir():
    """Where our libllama, libggml*, libempanel and empanel.h live: EMPANEL_GGUF_LIB_DIR, else the
    package's lib/ (native.py loads the libraries from here)."""
    return Path(os.environ.get("EMPANEL_GGUF_LIB_DIR") or PACKAGE_DIR / "lib")


def header_path(source=SOURCE_HEADER):
    """A header as installed next to the libraries (lib_dir()), else the source tree's: empanel.h,
    or llama-empanel-shared.h (source=SOURCE_SHARED_HEADER)."""
    lib = lib_dir()
    for path in (lib / source.name, source):
        if path.exists():
            return path
    raise FileNotFoundError(f"{source.name} is missing from {lib}; reinstall empanel-gguf")


def x_list(header_text, macro):
    """The argument lists of the entries X(...) of `#define macro(X)` in header_text, as strings."""
    match = re.search(rf"#define {macro}\(X\)((?:[^\n]*\\\n)*[^\n]*)", header_text)
    if match is None:
        raise ValueError(f"empanel.h has no {macro} list")
    entries = re.findall(r'X\(((?:[^()"]|"(?:[^"\\]|\\.)*")*)\)', match.group(1))
    if not entries:
        raise ValueError(f"empanel.h: {macro} is empty")
    return entries


def _fields(entry):
    """'a, b, "c, d"' -> ['a', 'b', 'c, d']: bare words and quoted strings."""
    return [quoted if bare == "" else bare for quoted, bare in re.findall(r'"((?:[^"\\]|\\.)*)"|([^,\s"]+)', entry)]


def parse_counters(header_text):
    """EMPANEL_LAYER_COUNTERS of a header's text, in order."""
    return tuple(Counter(*_fields(e)) for e in x_list(header_text, "EMPANEL_LAYER_COUNTERS"))


def parse_policies(header_text):
    """[(id, name)] of EMPANEL_POLICIES of a header's text, in enum order."""
    return [tuple(_fields(e)) for e in x_list(header_text, "EMPANEL_POLICIES")]


def parse_version(header_text):
    """EMPANEL_SIDECAR_VERSION of a header's text."""
    match = re.search(r"#define EMPANEL_SIDECAR_VERSION (\d+)", header_text)
    if match is None:
        raise ValueError("empanel.h has no EMPANEL_SIDECAR_VERSION")
    return int(match.group(1))


def parse_defines(header_text):
    """{name: value} of every `#define EMPANEL_NAME <integer>` of a header's text."""
    return {name: int(value) for name, value in re.findall(r"^#define (EMPANEL_\w+)[ \t]+(\d+)\b", header_text, re.M)}


def parse_enum(header_text, enum, prefix):
    """{name: value} of `enum <enum> { <prefix>NAME = value, ... }`, names lowercased without the
    prefix."""
    match = re.search(rf"enum {enum}\s*\{{(.*?)\}};", header_text, re.S)
    if match is None:
        raise ValueError(f"empanel.h has no enum {enum}")
    body = re.sub(r"//[^\n]*", "", match.group(1))
    return {name.lower(): int(value) for name, value in re.findall(rf"\b{prefix}(\w+)\s*=\s*(\d+)", body)}


def parse_shared_defines(header_text):
    """{NAME: value} of every `#define LLAMA_EMPANEL_NAME <integer>` of llama-empanel-shared.h."""
    return {name: int(value) for name, value in
            re.findall(r"^#define LLAMA_EMPANEL_(\w+)[ \t]+(\d+)\b", header_text, re.M)}


def define(name):
    """The value of `#define name <integer>` in empanel.h; ValueError if it has none."""
    if name not in DEFINES:
        raise ValueError(f"empanel.h ({header_path()}) has no #define {name}; reinstall empanel-gguf")
    return DEFINES[name]


HEADER_TEXT = header_path().read_text()
COUNTERS = parse_counters(HEADER_TEXT)
ENGINE_POLICIES = tuple(name for _, name in parse_policies(HEADER_TEXT))
SIDECAR_VERSION = parse_version(HEADER_TEXT)
DEFINES = parse_defines(HEADER_TEXT)
READ_IO = parse_enum(HEADER_TEXT, "empanel_read_io", "EMPANEL_READ_IO_")
SHARED_DEFINES = parse_shared_defines(header_path(SOURCE_SHARED_HEADER).read_text())
API_VERSION = SHARED_DEFINES["API_VERSION"]
READ_ALIGN = SHARED_DEFINES["READ_ALIGN"]


def policy_id(name):
    """enum empanel_policy of a policy name ("lru", "lfu-decay", "g-lru"); ValueError if unknown."""
    if name not in ENGINE_POLICIES:
        raise ValueError(f"moe_policy={name!r}: one of {', '.join(ENGINE_POLICIES)}")
    return ENGINE_POLICIES.index(name)
