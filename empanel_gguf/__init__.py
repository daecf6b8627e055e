"""empanel-gguf: run Mixture-of-Experts GGUF models larger than memory.

Each MoE layer keeps a pool of expert slots; the experts the router picks are read from the
unmodified GGUF file on demand. Importing this package makes llama_cpp use empanel-gguf's own
build of llama.cpp (see engine/native.py), so import it before llama_cpp.
"""

__version__ = "0.1.0"

from .engine.native import NativeLibraryError, use_our_libraries

llama_cpp = use_our_libraries()

from .llama import Llama, MoeReadError  # noqa: E402  (needs llama_cpp loaded as above)

__all__ = ["Llama", "MoeReadError", "NativeLibraryError", "llama_cpp", "__version__"]
