#pragma once

// load.c: a load on slot pools from its plan (empanel_load_*, empanel.h): the same steps for a
// load in the Python process and for llama.cpp's programs (program.c). The only unit that calls
// libllama (llama-empanel.h).

#include "plan_file.h"

struct empanel_pool;

// an open load (empanel_load_open .. empanel_load_close)
struct empanel_load {
    struct empanel_pool * pool;
    struct empanel_plan   plan;
    int32_t  n_masked;          // pools whose waves are masked
    uint64_t t_open_ns;
    struct empanel_load * next; // open loads (metrics)
};

// the Prometheus text of every open load (model: the plan's model path) into buf [size], as
// empanel_metrics_pools writes it; the length of the whole text
size_t empanel_load_metrics(char * buf, size_t size);
