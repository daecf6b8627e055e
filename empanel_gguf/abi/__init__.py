"""The facts the Python side shares with the native code, read as data and loading no library:
the llama.cpp that empanel-gguf builds on (pins), and what csrc/empanel.h declares: counters,
policies, read paths, the pool's defaults and bounds, versions (header).

Every package may import this one and it imports none of them: planning reads it without the
native seam, the engine checks the libraries against it. This file imports nothing, so that the
build can read pins.py by path.
"""
