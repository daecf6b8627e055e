"""empanel-gguf's start-up hook for `empanel-gguf exec` (this directory is put on PYTHONPATH).

Python imports `sitecustomize` at start-up. This one
  1. runs the sitecustomize that would have run without it (the next one on sys.path), if any;
  2. when EMPANEL_MOE_SLOTS is set, waits for the program's first `import llama_cpp` and then
     makes `llama_cpp.Llama` (and `llama_cpp.llama.Llama`) empanel_gguf's Llama, with moe_slots
     defaulting to EMPANEL_MOE_SLOTS (see empanel_gguf/commands/exec.py).
Nothing of empanel_gguf or llama_cpp is imported before the program imports llama_cpp.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(_HERE))  # the directory holding empanel_gguf/


def _chain_sitecustomize():
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_empanel_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


def _import_empanel_gguf():
    """The empanel_gguf next to this file (not another copy on sys.path)."""
    if "empanel_gguf" in sys.modules:
        return sys.modules["empanel_gguf"]
    sys.path.insert(0, _PACKAGE_ROOT)
    try:
        import empanel_gguf
    finally:
        try:
            sys.path.remove(_PACKAGE_ROOT)
        except ValueError:
            pass
    return empanel_gguf


class _LoaderWithHook(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _import_empanel_gguf()
        from empanel_gguf.commands.exec import patch_llama_cpp

        patch_llama_cpp(module)

    def __getattr__(self, name):  # get_resource_reader, is_package, ... of the real loader
        return getattr(self._loader, name)


class _LlamaCppFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "llama_cpp":
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]  # once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _LoaderWithHook(spec.loader)
        return spec


_chain_sitecustomize()
if os.environ.get("EMPANEL_MOE_SLOTS") is not None and "llama_cpp" not in sys.modules:
    sys.meta_path.insert(0, _LlamaCppFinder())
