#!/usr/bin/env python3
"""Repack speed per core: ggml-cpu's repack of one expert (patch 0003's expert-slice path, what the
readers call for CPU_REPACK pools) against the sidecar's own (csrc/repack.c), for each type ggml
repacks on this CPU. GB/s of the file's bytes, one thread, from cold memory (a 512 MiB ring of
sources, as an expert just read by O_DIRECT) and from warm (the same source again).

  python3 scripts/repack_speed.py [--build build/py3-none-linux_x86_64] [--seconds 2]

Needs a built tree (the ggml headers of its llama.cpp copy) and the installed libraries in
empanel_gguf/lib; compiles a small C program with cc.
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "repack.h"

typedef int (*slice_fn)(struct ggml_tensor *, const void *, size_t, int64_t);
typedef ggml_backend_buffer_type_t * (*extra_fn)(ggml_backend_dev_t);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void quiet(enum ggml_log_level level, const char * text, void * data) { (void) level; (void) text; (void) data; }

static slice_fn ggml_slice;
static void by_ggml(struct ggml_tensor * t, const uint8_t * src, int64_t i2) { ggml_slice(t, src, t->nb[2], i2); }
static void by_own(struct ggml_tensor * t, const uint8_t * src, int64_t i2) {
    uint8_t * dst = (uint8_t *) t->data + i2 * t->nb[2];
    if (t->type == GGML_TYPE_Q4_K) empanel_repack_q4_K_8x8(dst, src, t->ne[1], t->ne[0] / 256);
    else                           empanel_repack_q2_K_8x8(dst, src, t->ne[1], t->ne[0] / 256);
}

// GB/s of file bytes: cold (a new source each time, from a ring larger than the caches), warm
static void speed(struct ggml_tensor * t, void (*fn)(struct ggml_tensor *, const uint8_t *, int64_t),
                  const uint8_t * ring, int n_ring, double seconds, double * cold, double * warm) {
    const size_t size = t->nb[2];
    long n = 0; double t0 = now(), t1;
    do { fn(t, ring + (size_t) (n % n_ring) * size, n % t->ne[2]); n++; t1 = now(); } while (t1 - t0 < seconds);
    *cold = (double) size * n / (t1 - t0) / 1e9;
    n = 0; t0 = now();
    do { fn(t, ring, n % t->ne[2]); n++; t1 = now(); } while (t1 - t0 < seconds / 2);
    *warm = (double) size * n / (t1 - t0) / 1e9;
}

int main(int argc, char ** argv) {
    const double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    ggml_log_set(quiet, NULL); // (ggml logs every repack call)
    ggml_backend_load_all();
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    extra_fn extra = (extra_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    ggml_slice = (slice_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_repack_set_slice");
    ggml_backend_buffer_type_t repack = NULL;
    for (ggml_backend_buffer_type_t * b = extra != NULL ? extra(dev) : NULL; b != NULL && *b != NULL; b++) {
        repack = strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0 ? *b : repack;
    }
    if (repack == NULL || ggml_slice == NULL) { printf("no CPU_REPACK buffer type in this build\n"); return 1; }
    const enum ggml_type types[] = { GGML_TYPE_Q4_0, GGML_TYPE_Q4_K, GGML_TYPE_IQ4_NL, GGML_TYPE_MXFP4, GGML_TYPE_Q2_K,
                                     GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_Q8_0 };
    printf("| type | expert tensor | ggml cold GB/s | ggml warm GB/s | own cold GB/s | own warm GB/s |\n|---|---|---|---|---|---|\n");
    for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++) {
        struct ggml_init_params params = { 4 * ggml_tensor_overhead(), NULL, true };
        struct ggml_context * ctx = ggml_init(params);
        struct ggml_tensor * t = ggml_new_tensor_3d(ctx, types[k], 2048, 768, 8); // [n_embd, n_ff, 8 slots], 30B-A3B's
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, repack);
        if (buf == NULL || t->extra == NULL) {
            printf("| %s | not repacked on this CPU | | | | |\n", ggml_type_name(types[k]));
            ggml_free(ctx);
            continue;
        }
        const int n_ring = (int) ((512u << 20) / t->nb[2]);
        uint8_t * ring = malloc(t->nb[2] * n_ring);
        for (size_t i = 0; i < t->nb[2] * n_ring; i++) ring[i] = (uint8_t) (rand() >> 7);
        double gc, gw, oc = 0, ow = 0;
        speed(t, by_ggml, ring, n_ring, seconds, &gc, &gw);
        int own = types[k] == GGML_TYPE_Q4_K || types[k] == GGML_TYPE_Q2_K;
        if (own) {
            uint8_t * theirs = malloc(t->nb[2]);
            by_ggml(t, ring, 0); memcpy(theirs, t->data, t->nb[2]);
            by_own(t, ring, 0);
            own = memcmp(theirs, t->data, t->nb[2]) == 0; // (another layout on this CPU: not used)
            free(theirs);
        }
        if (own) speed(t, by_own, ring, n_ring, seconds, &oc, &ow);
        if (own) printf("| %s | %.2f MiB | %.2f | %.2f | %.2f | %.2f |\n", ggml_type_name(types[k]), t->nb[2] / 1048576.0, gc, gw, oc, ow);
        else     printf("| %s | %.2f MiB | %.2f | %.2f | - | - |\n", ggml_type_name(types[k]), t->nb[2] / 1048576.0, gc, gw);
        free(ring); ggml_backend_buffer_free(buf); ggml_free(ctx);
    }
    return 0;
}
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=str(REPO / "build" / "py3-none-linux_x86_64"), help="the built tree")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per cold measurement")
    args = parser.parse_args()
    include = Path(args.build) / "llama.cpp" / "ggml" / "include"
    lib = REPO / "empanel_gguf" / "lib"
    if not include.is_dir() or not (lib / "libggml-base.so").is_file():
        sys.exit(f"repack_speed: no ggml headers under {include} or no libraries in {lib}: build first")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "repack_speed.c", Path(tmp) / "repack_speed"
        src.write_text(PROGRAM)
        subprocess.run(["cc", "-O3", str(src), str(REPO / "csrc" / "repack.c"), f"-I{include}", f"-I{REPO / 'csrc'}",
                        f"-L{lib}", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(exe)], check=True)
        return subprocess.run([str(exe), str(args.seconds)]).returncode


if __name__ == "__main__":
    sys.exit(main())
