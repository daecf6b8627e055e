"""Benchmark empanel-gguf against stock llama.cpp (same build) on a MoE GGUF, llama-bench style.

    empanel-gguf bench --write-model /data/qwen3-30b-a3b.gguf            # write (or reuse), then bench
    empanel-gguf bench --write-model /data/gpt-oss-20b.gguf --shape gpt-oss-20b --write-only
    empanel-gguf bench -m MODEL.gguf -r 3 -p 64 -n 32 --json out.json    # bench an existing model
    empanel-gguf bench --write-model tiny.gguf --shape synthetic --layers 2 --experts 16 --top-k 4 \
        --embd 256 --expert-ff 256 --heads 4 --heads-kv 2 --head-dim 64 --write-only  # a tiny model only

(`python scripts/bench.py ...` runs the same on the working tree's package.)

What it does, in one run and one build:
- Optionally writes a MoE GGUF of a real model's shape with random weights (--shape: the default
  qwen3-30b-a3b-q4_k_m, gpt-oss-20b, deepseek-v2-lite, with their real vocabulary sizes and the
  tensor types llama-quantize's recipe gives them; or synthetic, the first one: Qwen3-30B-A3B's
  layers, every matrix Q4_K, 401 tokens), written as raw random blocks (no quantizer), streamed
  tensor by tensor; a file whose metadata carries the same shape fingerprint is reused.
- Measures each configuration in its own child process (own peak RSS, own page cache state; the
  page cache is dropped before each run): stock llama.cpp (moe_slots=None), stock with weights
  served from the mapping (use_extra_bufts=False) at the machine's readahead and at 128 KiB, and
  empanel at 100 %, 50 %, 25 % and the minimum slots (= top-k); each uncapped and under a cgroup v1
  memory cap (default 40 % of the model). Children over the cap are OOM-killed; that is a result.
  Uncapped runs get a guard group (available memory less 1 GiB) so an OOM kill hits the child.
- Measures the drive's own O_DIRECT bandwidth (random expert-sized ranges of the model, the reader's
  chunk size and queue depth) before and after every run and at the start and end, and reports
  each empanel row against the drive-bound ceiling: drive GB/s / bytes missed per token, capped by
  the resident decode rate. The disk's own counters (/sys/block/<dev>/stat) give its rate while
  busy during each phase; /proc/stat gives the CPU time other processes took during each run
  (this machine is shared; --wait-idle waits for quiet CPUs before each run).
- Every run feeds the same tokens: a fixed prompt (pp) and a fixed forced continuation (tg, one
  token per eval, no sampling), so all arms see the same routing.

Output: a markdown table (stdout), a details table (scripts/bench.py adds issue 4's targets), and --json with every
sample (rewritten after each run, so a long run can be watched). Progress goes to stderr.
Root-only steps (dropping caches, cgroups, readahead) have switches to turn them off.

Modules: synthetic (the model writer and its shapes; recipe: llama-quantize's tensor types, blocks:
random weights per type), host (the machine and the drive), configs, child (one
measured run, in its own process), runs (the parent: children, samples, rows), report (tables
and targets), cli (the command line and the driver).
"""

from .cli import main, setup_arg_parser
from .blocks import q4_k_blocks, random_rows
from .synthetic import (DEFAULT_SHAPE, FINGERPRINT_KEY, SHAPES, ModelShape, plan_bytes, plan_types, shape_fingerprint,
                        shape_with, tensor_plan, write_model)

__all__ = ["DEFAULT_SHAPE", "FINGERPRINT_KEY", "ModelShape", "SHAPES", "main", "plan_bytes", "plan_types", "q4_k_blocks",
           "random_rows", "setup_arg_parser", "shape_fingerprint", "shape_with", "tensor_plan", "write_model"]
