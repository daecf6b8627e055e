"""The native seam: the one place that points llama_cpp at our libraries and talks to C.

`import empanel_gguf` calls `use_our_libraries()`, which sets LLAMA_CPP_LIB_PATH before the first
`import llama_cpp`, imports it, and checks that the libllama it loaded carries our hooks and was
built from the pinned llama.cpp. The sidecar (libempanel, csrc/empanel.h) is opened with cffi in
ABI mode: no compiler is needed at run time.
"""

import ctypes
import os
import re
import sys

from ..abi import pins
from ..abi.header import API_VERSION, HEADER_TEXT, SIDECAR_VERSION, header_path, lib_dir, parse_counters, parse_policies


_sidecar = None  # Native, once opened


class NativeLibraryError(ImportError):
    """Our native libraries are missing, foreign, or from another build."""


def _shared_lib_name(stem):
    if sys.platform == "darwin":
        return f"lib{stem}.dylib"
    if sys.platform == "win32":
        return f"{stem}.dll"
    return f"lib{stem}.so"


def _loaded_llama_path(llama_cpp_module):
    lib = getattr(llama_cpp_module.llama_cpp, "_lib", None)
    return getattr(lib, "_name", "?")


def _check_llama(lib, where):
    """Raise NativeLibraryError unless `lib` (a ctypes CDLL of libllama) is our patched build."""
    try:
        api_version = lib.llama_empanel_api_version
        commit_fn = lib.llama_empanel_llama_commit
    except AttributeError:
        raise NativeLibraryError(
            f"llama_cpp loaded {where}, a libllama without the empanel hooks "
            "(llama_empanel_api_version is missing).\n"
            f"HINT: import empanel_gguf before llama_cpp, unset LLAMA_CPP_LIB_PATH, or rebuild "
            f"empanel-gguf (pip install .) so that {lib_dir()} holds its libraries."
        ) from None
    api_version.restype = ctypes.c_int32
    commit_fn.restype = ctypes.c_char_p
    version = api_version()
    commit = commit_fn().decode()
    if version != API_VERSION or commit != pins.LLAMA_COMMIT:
        raise NativeLibraryError(
            f"llama_cpp loaded {where}: empanel API {version} on llama.cpp {commit[:12]}, but this "
            f"empanel_gguf expects API {API_VERSION} on llama.cpp "
            f"{pins.LLAMA_COMMIT[:12]}.\nHINT: the package and its libraries come from different "
            "builds; reinstall empanel-gguf (pip install --force-reinstall .)."
        )


# the public structs llama-cpp-python mirrors with ctypes; our patches must not change their size
MIRRORED_STRUCTS = (
    "llama_model_params",
    "llama_context_params",
    "llama_batch",
    "llama_model_quantize_params",
    "llama_sampler_chain_params",
    "llama_token_data",
    "llama_chat_message",
)


def _check_struct_sizes(llama_cpp_module):
    """Compare the C sizeof() of each mirrored struct, as our build compiled llama.h
    (empanel_struct_size in libempanel), with its ctypes mirror."""
    try:
        size_fn = ctypes.CDLL(str(lib_dir() / _shared_lib_name("empanel"))).empanel_struct_size
    except (OSError, AttributeError) as e:
        raise NativeLibraryError(f"could not load the sidecar library in {lib_dir()}: {e}\n"
                                 "HINT: rebuild empanel-gguf (pip install .)") from e
    size_fn.argtypes = [ctypes.c_char_p]
    size_fn.restype = ctypes.c_size_t
    for name in MIRRORED_STRUCTS:
        c_size = size_fn(name.encode())
        py_size = ctypes.sizeof(getattr(llama_cpp_module.llama_cpp, name))
        if c_size != py_size:
            raise NativeLibraryError(
                f"ABI mismatch: sizeof({name}) is {c_size} bytes in {_loaded_llama_path(llama_cpp_module)} "
                f"but {py_size} in llama_cpp's ctypes bindings.\nHINT: install "
                f"llama-cpp-python=={pins.LLAMA_CPP_PYTHON_VERSION}, the version empanel-gguf is built for."
            )


def use_our_libraries():
    """Make llama_cpp load our libraries, import it, and verify them. Returns the llama_cpp module."""
    if "llama_cpp" in sys.modules:
        # too late to choose the library: accept it only if it is ours
        import llama_cpp

        _check_llama(llama_cpp.llama_cpp._lib, _loaded_llama_path(llama_cpp))
        _check_struct_sizes(llama_cpp)
        return llama_cpp

    ours = lib_dir()
    if not (ours / _shared_lib_name("llama")).exists():
        raise NativeLibraryError(
            f"empanel-gguf's native libraries are not built: {ours / _shared_lib_name('llama')} "
            "is missing.\nHINT: build and install the package from its source tree with "
            "`pip install .` (see README.md), or set EMPANEL_GGUF_LIB_DIR to a build's lib folder."
        )
    os.environ["LLAMA_CPP_LIB_PATH"] = str(ours)
    os.environ.setdefault("MTMD_CPP_LIB", str(ours))  # no libmtmd is built; keep it from others

    try:
        import llama_cpp
    except OSError as e:  # ctypes could not load one of the libraries
        raise NativeLibraryError(f"could not load the libraries in {ours}: {e}") from e
    _check_llama(llama_cpp.llama_cpp._lib, _loaded_llama_path(llama_cpp))
    _check_struct_sizes(llama_cpp)
    return llama_cpp


def _cdef_from_header(text):
    """The declarations of empanel.h in a form cffi's cdef accepts: no comments, no preprocessor
    lines (continued ones included), no export macros, no extern "C" braces, and the counters'
    struct and the policies' enum written out from their lists (header.py)."""
    fields = "\n".join(f"    uint64_t {c.field};" for c in parse_counters(text))
    policies = ", ".join(f"EMPANEL_POLICY_{policy_id}" for policy_id, _ in parse_policies(text))
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"\\\n", " ", text)  # a #define continued over lines is one line
    text = text.replace("EMPANEL_LAYER_COUNTERS(EMPANEL_COUNTER_FIELD)", fields)
    text = text.replace("EMPANEL_POLICIES(EMPANEL_POLICY_ENUM)", policies)
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or stripped in ('extern "C" {', "}"):
            continue
        lines.append(line.replace("EMPANEL_API ", ""))
    return "\n".join(lines)


# the parts of libllama's C API (llama.h, llama-empanel.h) that the sidecar is wired up with
_LLAMA_CDEF = """
void    llama_empanel_clear_plan(void);
struct llama_empanel_pool_info { void * tensor; int64_t n_slots; uint64_t slot_bytes; _Bool masked; };
int32_t llama_empanel_n_pools(const void * model);
_Bool   llama_empanel_pool_info(const void * model, const char * name, struct llama_empanel_pool_info * info);
void    llama_set_abort_callback(void * ctx, _Bool (*abort_callback)(void *), void * data);
"""


class Native:
    """cffi handles: `ffi`, `sidecar` (libempanel) and `llama` (our libllama, as loaded by llama_cpp)."""

    def __init__(self):
        import cffi

        self.ffi = cffi.FFI()
        self.ffi.cdef(_cdef_from_header(HEADER_TEXT))
        self.ffi.cdef(_LLAMA_CDEF)
        # libllama first: libempanel links it, and it must be the very library llama_cpp loaded
        self.llama = self.ffi.dlopen(str(lib_dir() / _shared_lib_name("llama")))
        self.sidecar = self.ffi.dlopen(str(lib_dir() / _shared_lib_name("empanel")))
        version = self.sidecar.empanel_sidecar_version()
        if version != SIDECAR_VERSION:
            raise NativeLibraryError(
                f"{lib_dir() / _shared_lib_name('empanel')} is sidecar version {version}, but its empanel.h "
                f"({header_path()}) declares version {SIDECAR_VERSION}: the library and the package come from "
                "different builds.\nHINT: reinstall empanel-gguf (pip install --force-reinstall .).")

    def ptr(self, ctypes_pointer):
        """A llama-cpp-python ctypes pointer (c_void_p) as a cffi void *."""
        value = ctypes_pointer.value if hasattr(ctypes_pointer, "value") else ctypes_pointer
        return self.ffi.cast("void *", value or 0)


def native():
    """The Native handles, made once."""
    global _sidecar
    if _sidecar is None:
        _sidecar = Native()
    return _sidecar


def hash64(data):
    """XXH3-64 of a bytes-like object, by the sidecar: the digest of verified reads (never 0,
    which means unknown)."""
    n = native()
    return int(n.sidecar.empanel_hash64(n.ffi.from_buffer(data), len(data)))


def uring_available():
    """(True, "") if this build and kernel read with io_uring (moe_read_io="uring"), else (False,
    why)."""
    n = native()
    why = n.ffi.new("char[]", 256)
    ok = bool(n.sidecar.empanel_uring_available(why, 256))
    return ok, n.ffi.string(why).decode(errors="replace")
