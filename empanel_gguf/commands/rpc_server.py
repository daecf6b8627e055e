"""`empanel-gguf rpc-server [-H HOST] [-p PORT] [-t N] [-c] [-d DEV,...]`: llama.cpp's ggml-rpc-server, this build's.

Exposes this host's backend (its CPU, or its GPUs) to another host's `--rpc HOST:PORT` (Llama's
rpc_servers=): the layers llama.cpp places here, and their expert slot pools, live in this host's
memory, and the computations of those layers run here. With -c (the cache, under $LLAMA_CACHE/rpc
or ~/.cache/llama.cpp/rpc) every expert it is sent is kept on this host's drive by hash, and a
later miss on it costs a request naming its hash (about 330 bytes) instead of its bytes: use -c
for slot pools.
Every flag is ggml-rpc-server's own (--help lists them). It serves one client at a time, and
listens on 127.0.0.1 unless -H says otherwise (there is no authentication: a trusted network only).
Exit status: the server's; 1 if it is not built.
"""

import os
import sys

from .options import note


def main(argv=None):
    from .programs import program_path, run_program

    flags = list(sys.argv[1:] if argv is None else argv)
    if flags and flags[0] in ("--moe-help",):
        print(__doc__)
        return 0
    try:
        path = program_path("ggml-rpc-server")
    except FileNotFoundError:
        print("empanel-gguf rpc-server: ggml-rpc-server is not built in this install: the package builds it "
              "unless CMAKE_ARGS has -DGGML_RPC=OFF; reinstall without it", file=sys.stderr)
        return 1
    if not any(flag in ("-c", "--cache", "-h", "--help") for flag in flags):
        note("rpc-server without -c: every expert a slot pool misses is sent over the wire again "
             "(with -c this host keeps them, and a miss costs a hash)")
    return run_program(path, flags, dict(os.environ))
