// A load on slot pools, from its plan: the same steps for a load in the Python process
// (empanel_gguf/engine/pools.py) and for llama.cpp's own programs (llama-server, llama-cli, llama-bench,
// llama-perplexity), so that the two never drift apart.
//
//   empanel_load_open    read the plan (text or file), make the pools, hand over the digests
//   empanel_load_begin   set the plan for the model load that follows on this thread
//   empanel_load_bind    after the load: bind the pools to the model's pool tensors, hand over the
//                        warm start's preload order
//   empanel_load_preload fill the empty slots (when the plan says so; the caller reports it)
//   empanel_load_close   append the counters to the plan's stats file, free the pools
//
// `empanel-gguf llama-server ...` plans in Python as for Llama (plan.py), writes the plan to a
// file and runs the program with EMPANEL_PLAN=<that file>. At each load of the model the plan
// names, libllama's program hook (llama-empanel-program.cpp) loads this library (the libempanel
// next to that libllama, or EMPANEL_SIDECAR) and calls empanel_program_open before the load,
// empanel_program_loaded after it (the steps above, with the notices on stderr: program.c), and
// empanel_load_pool / empanel_load_close: no Python in the program. Every open load is listed
// for llama-server's /metrics (empanel_load_metrics; metrics.c writes the text and the stats
// file's lines).
//
// The plan's records: plan_file.c. Of the sidecar's units only this one calls libllama.

#include "load.h"
#include "budget.h"
#include "files.h"
#include "host_cache.h"
#include "metrics.h"
#include "plan_file.h"
#include "pool.h"
#include "preload.h"
#include "stats.h"
#include "util.h"
#include "state.h"

#include "llama-empanel.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t       g_loads_lock = PTHREAD_MUTEX_INITIALIZER;
static struct empanel_load * g_loads      = NULL;

static void load_free(struct empanel_load * load) {
    if (load == NULL) {
        return;
    }
    if (load->pool != NULL) {
        empanel_pool_free(load->pool);
    }
    empanel_plan_free(&load->plan);
    free(load);
}

// the plan read (rc 1 of empanel_plan_read*): its pools and digests; NULL on failure (err set)
static struct empanel_load * load_make(struct empanel_load * load, const char * source, char * err,
                                       size_t err_size) {
    struct empanel_plan * plan = &load->plan;
    load->pool = empanel_pool_init(&plan->params, (const char * const *) plan->paths, plan->n_paths,
                                   plan->n_layer, plan->n_slots, plan->n_expert, plan->tensors,
                                   plan->n_tensors, err, err_size);
    if (load->pool == NULL) {
        load_free(load);
        return NULL;
    }
    for (int32_t i = 0; i < plan->n_digests; i++) {
        const struct empanel_plan_digests * d = &plan->digests[i];
        if (empanel_pool_set_digests(load->pool, d->name, d->digests, d->n) != 0) {
            empanel_util_format_err(err, err_size, "%s: digests for %s refused (unknown tensor, or the plan does not verify)",
                    source, d->name);
            load_free(load);
            return NULL;
        }
    }
    load->t_open_ns = empanel_util_now_ns();
    pthread_mutex_lock(&g_loads_lock);
    load->next = g_loads;
    g_loads = load;
    pthread_mutex_unlock(&g_loads_lock);
    return load;
}

struct empanel_load * empanel_load_open(const char * plan_text, const char * plan_path, const char * model_path,
                                        char * err, size_t err_size) {
    struct empanel_load * load = calloc(1, sizeof(*load));
    if (load == NULL) {
        empanel_util_format_err(err, err_size, "%s: out of memory", plan_path != NULL ? plan_path : "the plan");
        return NULL;
    }
    const int rc = plan_text != NULL ? empanel_plan_read_text(plan_text, model_path, &load->plan, err, err_size)
                                     : empanel_plan_read(plan_path, model_path, &load->plan, err, err_size);
    if (rc <= 0) {
        free(load); // 0: not the planned model, which loads as usual (err is "")
        return NULL;
    }
    return load_make(load, plan_text != NULL ? "the plan" : plan_path, err, err_size);
}

void empanel_load_begin(struct empanel_load * load) {
    const struct empanel_plan * plan = &load->plan;
    llama_empanel_set_plan(plan->n_slots, plan->n_layer, (llama_empanel_remap_fn) empanel_remap, load->pool);
    llama_empanel_set_pinned(plan->pinned != 0);
    if (plan->guess_depth > 0) {
        llama_empanel_set_guess((llama_empanel_guess_fn) empanel_guess, plan->guess_depth);
    }
    if (plan->subst_alt > 0) {
        llama_empanel_set_subst((llama_empanel_subst_fn) empanel_subst, plan->subst_alt);
    }
    // reads overlap the layer's compute (EMPANEL_READ_SYNC=1: every remap waits for its reads, to
    // measure the difference side by side)
    const char * sync = getenv("EMPANEL_READ_SYNC");
    if (sync == NULL || atoi(sync) == 0) {
        llama_empanel_set_ready((llama_empanel_ready_fn) empanel_ready);
    }
}

// the controller started on the plan's memory sources (pools that cannot give memory back stay
// as they are, saying so once); 0, or -1 with why in err
static int load_watch_memory(struct empanel_load * load, char * err, size_t err_size) {
    if (load->pool->budget.fixed_why != NULL) {
        fprintf(stderr, "empanel: moe_elastic: the pools keep their memory: %s\n", load->pool->budget.fixed_why);
        return 0;
    }
    struct empanel_memory_source sources[EMPANEL_MAX_MEMORY_SOURCES];
    for (int32_t i = 0; i < load->plan.n_memory; i++) {
        const struct empanel_plan_memory * m = &load->plan.memory[i];
        sources[i] = (struct empanel_memory_source) {
            .limit_path     = m->path[PLAN_MEMORY_LIMIT],
            .high_path      = m->path[PLAN_MEMORY_HIGH],
            .usage_path     = m->path[PLAN_MEMORY_USAGE],
            .stat_path      = m->path[PLAN_MEMORY_STAT],
            .events_path    = m->path[PLAN_MEMORY_EVENTS],
            .stat_key       = m->stat_key,
            .available_path = m->path[PLAN_MEMORY_AVAILABLE],
            .available_key  = m->available_key,
        };
    }
    return empanel_pool_watch_memory(load->pool, sources, load->plan.n_memory, load->plan.reserve_bytes,
                                     load->plan.interval_ms, err, err_size) == 0 ? 0 : -1;
}

int32_t empanel_load_bind(struct empanel_load * load, const struct llama_model * model, char * err,
                          size_t err_size) {
    const int32_t n_pools = llama_empanel_n_pools(model);
    if (n_pools != load->plan.n_tensors) {
        // name the planned tensors llama.cpp made no pool for (it skipped or never created them)
        char   missing[512] = "";
        size_t used = 0;
        int32_t n_missing = 0;
        for (int32_t i = 0; i < load->plan.n_tensors; i++) {
            struct llama_empanel_pool_info info;
            if (llama_empanel_pool_info(model, load->plan.tensor_names[i], &info)) {
                continue;
            }
            if (n_missing++ < 4 && used + 2 < sizeof(missing)) {
                int n = snprintf(missing + used, sizeof(missing) - used, "%s%s", used > 0 ? ", " : "",
                                 load->plan.tensor_names[i]);
                used = n > 0 ? used + (size_t) n : used;
                used = used < sizeof(missing) ? used : sizeof(missing) - 1;
            }
        }
        empanel_util_format_err(err, err_size, "llama.cpp made %d slot pools for the %d routed-expert tensors the plan pages "
                "in %s; %d of them got no pool (llama.cpp skipped or did not create them: %s%s). An MTP block "
                "is loaded only with MTP drafting (load_mtp); plan the load as it is made", n_pools,
                load->plan.n_tensors, load->plan.model, n_missing, n_missing > 0 ? missing : "none; others were made",
                n_missing > 4 ? ", ..." : "");
        return -1;
    }
    // the files llama.cpp read the dense weights from must be the ones our reads take experts from
    // (0: a model without pools, nothing to compare)
    const int32_t n_files = llama_empanel_model_file(model, -1, NULL, NULL);
    if (n_files > 0 && n_files != load->pool->files.n) {
        empanel_util_format_err(err, err_size, "llama.cpp read %d file(s) of the model, the plan names %d: reload the model",
                                n_files, load->pool->files.n);
        return -1;
    }
    for (int32_t i = 0; i < n_files; i++) {
        uint64_t dev = 0, ino = 0;
        llama_empanel_model_file(model, i, &dev, &ino);
        if (empanel_files_match(load->pool, i, dev, ino, err, err_size) != 0) {
            return -1;
        }
    }
    load->n_masked = 0;
    for (int32_t i = 0; i < load->plan.n_tensors; i++) {
        struct llama_empanel_pool_info info = { 0 };
        const int made = llama_empanel_pool_info(model, load->plan.tensor_names[i], &info);
        if (empanel_pool_bind(load->pool, load->plan.tensor_names[i], made ? &info : NULL) != 0) {
            empanel_util_format_err(err, err_size, "%s", empanel_pool_error(load->pool));
            return -1;
        }
        load->n_masked += info.masked ? 1 : 0;
    }
    if (load->plan.host_cache_bytes > 0 && empanel_host_cache_init(load->pool, load->plan.host_cache_bytes, err, err_size) != 0) {
        return -1;
    }
    for (int32_t i = 0; i < load->plan.n_orders; i++) {
        const struct empanel_plan_order * o = &load->plan.orders[i];
        if (empanel_preload_order(load->pool, o->layer, o->experts, o->uses, o->n) != 0) {
            empanel_util_format_err(err, err_size, "layer %d: the profile's preload order was refused", o->layer);
            return -1;
        }
    }
    empanel_budget_settle(load->pool, load->plan.n_expert_used, load->plan.pinned);
    return load->plan.elastic ? load_watch_memory(load, err, err_size) : 0;
}

int64_t empanel_load_preload(struct empanel_load * load, char * err, size_t err_size) {
    if (!load->plan.preload) {
        return 0;
    }
    const int64_t n = empanel_preload(load->pool);
    if (n < 0) {
        empanel_util_format_err(err, err_size, "preloading experts: %s", empanel_pool_error(load->pool));
        empanel_pool_clear_error(load->pool);
        return n;
    }
    if (load->plan.pinned && empanel_preload_check_pinned(load->pool, err, err_size) != 0) {
        return -1; // a graph without remap ops would compute with the wrong experts
    }
    return n;
}

struct empanel_pool * empanel_load_pool(struct empanel_load * load) {
    return load->pool;
}

int32_t empanel_load_masked(struct empanel_load * load) {
    return load->n_masked;
}

void empanel_load_close(struct empanel_load * load) {
    if (load == NULL) {
        return;
    }
    pthread_mutex_lock(&g_loads_lock);
    for (struct empanel_load ** p = &g_loads; *p != NULL; p = &(*p)->next) {
        if (*p == load) {
            *p = load->next;
            break;
        }
    }
    pthread_mutex_unlock(&g_loads_lock);
    if (load->plan.stats_path[0] != '\0') {
        FILE * out = fopen(load->plan.stats_path, "a");
        if (out != NULL) {
            empanel_metrics_write_json(out, load->pool, (empanel_util_now_ns() - load->t_open_ns) / 1e9, load->n_masked,
                                       load->plan.n_expert_used);
            fclose(out);
        } else {
            fprintf(stderr, "empanel: could not write the statistics to %s: %s\n", load->plan.stats_path, strerror(errno));
        }
    }
    load_free(load);
}

size_t empanel_load_metrics(char * buf, size_t size) {
    pthread_mutex_lock(&g_loads_lock); // held while the text is written: no load closes meanwhile
    int32_t n = 0;
    for (const struct empanel_load * p = g_loads; p != NULL; p = p->next) {
        n++;
    }
    struct empanel_pool ** pools  = calloc((size_t) n + 1, sizeof(*pools));
    const char         ** models = calloc((size_t) n + 1, sizeof(*models));
    size_t len = 0;
    if (pools != NULL && models != NULL) {
        int32_t i = 0;
        for (const struct empanel_load * p = g_loads; p != NULL; p = p->next, i++) {
            pools[i]  = p->pool;
            models[i] = p->plan.model;
        }
        len = empanel_metrics_pools(pools, models, n, buf, size);
    } else if (buf != NULL && size > 0) {
        buf[0] = '\0';
    }
    pthread_mutex_unlock(&g_loads_lock);
    free(pools);
    free(models);
    return len;
}
