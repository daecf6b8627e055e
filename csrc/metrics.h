#pragma once

// metrics.c: the counters written out: a load's stats JSON line and the Prometheus text of pools
// (empanel_metrics_pools, empanel_metrics_label: empanel.h), one writer for llama.cpp's programs
// and `empanel-gguf serve`

#include "empanel.h"

#include <stddef.h>
#include <stdio.h>

// a text being written into buf [size] (NUL-terminated, truncated where it does not fit)
struct empanel_text {
    char * buf;
    size_t size;
    size_t len;  // what the whole text takes (may exceed size: truncated)
};

// the load's counters as one JSON object (a line of the plan's stats file): seconds open, pools
// whose waves are masked, the model's experts per token, the read path, the RPC wire, and every
// paged layer's EMPANEL_LAYER_COUNTERS
void empanel_metrics_write_json(FILE * out, struct empanel_pool * pool, double seconds, int32_t n_masked,
                                int32_t n_expert_used);
// printf onto the text
void empanel_metrics_add(struct empanel_text * t, const char * fmt, ...) __attribute__((format(printf, 2, 3)));
// the per-layer families (HELP, TYPE, a series per paged layer of each pool, model=models[i])
void empanel_metrics_families(struct empanel_text * t, struct empanel_pool * const * pools,
                              const char * const * models, int32_t n);
// (empanel_metrics_pools, the text of both faces: empanel.h)
#define EMPANEL_METRICS_MAX_MODELS 64 // models with pools one text lists
