"""The llama.cpp that empanel-gguf builds on, pinned in one place.

The build (scripts/llama_source.py, CMakeLists.txt) and the runtime check (native.py) both read
these values. Keep `llama-cpp-python==` in pyproject.toml equal to LLAMA_CPP_PYTHON_VERSION.
This module imports nothing: the build loads it by file path.
"""

# the llama-cpp-python source distribution whose vendored llama.cpp we patch and build
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_PYTHON_SDIST = "llama_cpp_python-0.3.36.tar.gz"
LLAMA_CPP_PYTHON_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

# the llama.cpp commit that sdist vendors (vendor/llama.cpp)
LLAMA_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
