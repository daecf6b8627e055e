// llama.cpp's programs (llama-server, llama-cli, llama-bench, llama-perplexity): libllama's
// program hook (llama-empanel-program.cpp) loads this library and calls these around each model
// load that EMPANEL_PLAN names: the steps of load.c, with the notices on stderr, and the
// Prometheus text of every open load for llama-server's /metrics (metrics.c writes it).

#include "program.h"
#include "load.h"
#include "stats.h"
#include "util.h"

#include <inttypes.h>
#include <stdio.h>

struct empanel_load * empanel_program_open(const char * plan_path, const char * model_path, char * err,
                                           size_t err_size) {
    struct empanel_load * load = empanel_load_open(NULL, plan_path, model_path, err, err_size);
    if (load == NULL) {
        return NULL;
    }
    if (empanel_pool_notice(load->pool)[0] != '\0') {
        fprintf(stderr, "empanel: %s\n", empanel_pool_notice(load->pool));
    }
    empanel_load_begin(load); // libllama clears the plan after the load
    return load;
}

int32_t empanel_program_loaded(struct empanel_load * load, const struct llama_model * model, char * err,
                               size_t err_size) {
    if (empanel_load_bind(load, model, err, err_size) != 0) {
        return -1;
    }
    const uint64_t t0 = empanel_util_now_ns();
    const int64_t  n  = empanel_load_preload(load, err, err_size);
    if (n < 0) {
        return -1;
    }
    if (load->plan.preload) {
        fprintf(stderr, "empanel: preloaded %" PRId64 " experts (%.1f MiB) into the pools in %.2f s\n", n,
                empanel_pool_resident_bytes(load->pool) / 1048576.0, (empanel_util_now_ns() - t0) / 1e9);
    }
    return 0;
}

void empanel_program_close(struct empanel_load * load) {
    empanel_load_close(load);
}

size_t empanel_program_metrics(char * buf, size_t size) {
    return empanel_load_metrics(buf, size);
}
