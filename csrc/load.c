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
// empanel_program_loaded after it (the steps above, with the notices on stderr), and
// empanel_load_pool / empanel_load_close: no Python in the program. Every open
// load is listed for llama-server's /metrics (empanel_program_metrics).
//
// The plan's records: plan_file.c.

#include "empanel.h"
#include "empanel-impl.h"

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

struct empanel_load {
    struct empanel_pool * pool;
    struct empanel_plan   plan;
    char     label[PATH_MAX];   // plan.model, escaped for a Prometheus label value (/metrics)
    int32_t  n_masked;          // pools whose waves are masked
    uint64_t t_open_ns;
    struct empanel_load * next; // open loads (metrics)
};

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
    size_t n_label = 0;
    for (const char * c = plan->model; *c && n_label + 2 < sizeof(load->label); c++) {
        if (*c == '"' || *c == '\\') {
            load->label[n_label++] = '\\';
        }
        load->label[n_label++] = *c == '\n' ? ' ' : *c;
    }
    load->label[n_label] = '\0';

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
            empanel_format_err(err, err_size, "%s: digests for %s refused (unknown tensor, or the plan does not verify)",
                    source, d->name);
            load_free(load);
            return NULL;
        }
    }
    load->t_open_ns = empanel_now_ns();
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
        empanel_format_err(err, err_size, "%s: out of memory", plan_path != NULL ? plan_path : "the plan");
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
        empanel_format_err(err, err_size, "llama.cpp made %d slot pools for the %d routed-expert tensors the plan pages "
                "in %s; %d of them got no pool (llama.cpp skipped or did not create them: %s%s). An MTP block "
                "is loaded only with MTP drafting (load_mtp); plan the load as it is made", n_pools,
                load->plan.n_tensors, load->plan.model, n_missing, n_missing > 0 ? missing : "none; others were made",
                n_missing > 4 ? ", ..." : "");
        return -1;
    }
    // the files llama.cpp read the dense weights from must be the ones our reads take experts from
    // (0: a model without pools, nothing to compare)
    const int32_t n_files = llama_empanel_model_file(model, -1, NULL, NULL);
    if (n_files > 0 && n_files != load->pool->n_files) {
        empanel_format_err(err, err_size, "llama.cpp read %d file(s) of the model, the plan names %d: reload the model",
                           n_files, load->pool->n_files);
        return -1;
    }
    for (int32_t i = 0; i < n_files; i++) {
        uint64_t dev = 0, ino = 0;
        llama_empanel_model_file(model, i, &dev, &ino);
        if (empanel_file_is(load->pool, i, dev, ino, err, err_size) != 0) {
            return -1;
        }
    }
    load->n_masked = 0;
    for (int32_t i = 0; i < load->plan.n_tensors; i++) {
        struct llama_empanel_pool_info info = { 0 };
        const int made = llama_empanel_pool_info(model, load->plan.tensor_names[i], &info);
        if (empanel_pool_bind(load->pool, load->plan.tensor_names[i], made ? &info : NULL) != 0) {
            empanel_format_err(err, err_size, "%s", empanel_pool_error(load->pool));
            return -1;
        }
        load->n_masked += info.masked ? 1 : 0;
    }
    if (load->plan.host_cache_bytes > 0 && empanel_host_cache_init(load->pool, load->plan.host_cache_bytes, err, err_size) != 0) {
        return -1;
    }
    for (int32_t i = 0; i < load->plan.n_orders; i++) {
        const struct empanel_plan_order * o = &load->plan.orders[i];
        if (empanel_pool_preload_order(load->pool, o->layer, o->experts, o->uses, o->n) != 0) {
            empanel_format_err(err, err_size, "layer %d: the profile's preload order was refused", o->layer);
            return -1;
        }
    }
    return 0;
}

int64_t empanel_load_preload(struct empanel_load * load, char * err, size_t err_size) {
    if (!load->plan.preload) {
        return 0;
    }
    const int64_t n = empanel_pool_preload(load->pool);
    if (n < 0) {
        empanel_format_err(err, err_size, "preloading experts: %s", empanel_pool_error(load->pool));
        empanel_pool_clear_error(load->pool);
        return n;
    }
    if (load->plan.pinned && empanel_pool_check_pinned(load->pool, err, err_size) != 0) {
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

// the counters of every paged layer as one JSON object (a line of the stats file)
static void write_stats(const struct empanel_load * load, FILE * out) {
    uint64_t wire_sent, wire_received, round_trips; // RPC servers (--rpc): this process's wire
    empanel_rpc_wire_bytes(&wire_sent, &wire_received, &round_trips);
    fprintf(out, "{\"seconds\": %.3f, \"masked_pools\": %d, \"n_expert_used\": %d, \"read_io\": \"%s\", "
            "\"wire_sent\": %" PRIu64 ", \"wire_received\": %" PRIu64 ", \"round_trips\": %" PRIu64 ", \"layers\": {",
            (empanel_now_ns() - load->t_open_ns) / 1e9, load->n_masked, load->plan.n_expert_used,
            empanel_pool_read_io(load->pool) == EMPANEL_READ_IO_URING ? "uring" : "threads", wire_sent,
            wire_received, round_trips);
    int first = 1;
    for (int32_t il = 0; il < load->plan.n_layer; il++) {
        if (load->plan.n_slots[il] <= 0) {
            continue;
        }
        struct empanel_layer_stats s;
        empanel_stats_get(load->pool, il, &s);
        fprintf(out, "%s\"%d\": {", first ? "" : ", ", il);
        const char * sep = "";
#define WRITE_COUNTER(field, kind, metric, help) \
        fprintf(out, "%s\"" #field "\": %" PRIu64, sep, s.field); \
        sep = ", ";
        EMPANEL_LAYER_COUNTERS(WRITE_COUNTER)
#undef WRITE_COUNTER
        fprintf(out, "}");
        first = 0;
    }
    fprintf(out, "}}\n");
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
            write_stats(load, out);
            fclose(out);
        } else {
            fprintf(stderr, "empanel: could not write the statistics to %s: %s\n", load->plan.stats_path, strerror(errno));
        }
    }
    load_free(load);
}

// -- llama.cpp's programs: libllama's program hook (llama-empanel-program.cpp) calls these ------

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
    const uint64_t t0 = empanel_now_ns();
    const int64_t  n  = empanel_load_preload(load, err, err_size);
    if (n < 0) {
        return -1;
    }
    if (load->plan.preload) {
        fprintf(stderr, "empanel: preloaded %" PRId64 " experts (%.1f MiB) into the pools in %.2f s\n", n,
                empanel_pool_resident_bytes(load->pool) / 1048576.0, (empanel_now_ns() - t0) / 1e9);
    }
    return 0;
}

void empanel_program_close(struct empanel_load * load) {
    empanel_load_close(load);
}

// -- Prometheus text of the open loads (llama-server's /metrics) -------------------------------

struct text_out {
    char * buf;
    size_t size;
    size_t len;  // what the whole text takes (may exceed size: truncated)
};

static void text_add(struct text_out * t, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    char * at = t->len < t->size ? t->buf + t->len : NULL;
    int n = vsnprintf(at, at != NULL ? t->size - t->len : 0, fmt, args);
    va_end(args);
    if (n > 0) {
        t->len += (size_t) n;
    }
}

// the per-layer series of /metrics: the counters of EMPANEL_LAYER_COUNTERS that name a metric
struct metric_def {
    const char * name;   // without the empanel_ prefix
    const char * type;   // counter, gauge
    const char * help;
    size_t       offset; // of its field in struct empanel_layer_stats
    int          ns;     // the field is in nanoseconds: shown in seconds
};

#define METRIC_DEF(field, kind, metric, help) \
    { metric, #kind, help, offsetof(struct empanel_layer_stats, field), is_ns_field(#field) },

static int is_ns_field(const char * field) {
    const size_t n = strlen(field);
    return n > 3 && strcmp(field + n - 3, "_ns") == 0;
}

static void metric_value(struct text_out * t, const struct metric_def * m, const struct empanel_layer_stats * s) {
    uint64_t value;
    memcpy(&value, (const char *) s + m->offset, sizeof(value));
    if (m->ns) {
        text_add(t, "%.9f", value / 1e9);
    } else {
        text_add(t, "%" PRIu64, value); // counts as integers: bytes pass 2^53 in long runs
    }
}

size_t empanel_program_metrics(char * buf, size_t size) {
    struct text_out t = { buf, size, 0 };
    if (buf != NULL && size > 0) {
        buf[0] = '\0';
    }
    const struct metric_def metrics[] = { EMPANEL_LAYER_COUNTERS(METRIC_DEF) };
    const int32_t n_metrics = (int32_t) (sizeof(metrics) / sizeof(metrics[0]));
    pthread_mutex_lock(&g_loads_lock);
    text_add(&t, "# HELP empanel_slot_pools 1 if the model runs with expert slot pools.\n"
                 "# TYPE empanel_slot_pools gauge\n");
    for (const struct empanel_load * p = g_loads; p != NULL; p = p->next) {
        text_add(&t, "empanel_slot_pools{model=\"%s\"} 1\n", p->label);
    }
    for (int32_t m = 0; m < n_metrics; m++) {
        const struct metric_def * def = &metrics[m];
        if (def->name[0] == '\0') {
            continue;
        }
        text_add(&t, "# HELP empanel_%s %s\n# TYPE empanel_%s %s\n", def->name, def->help, def->name, def->type);
        for (const struct empanel_load * p = g_loads; p != NULL; p = p->next) {
            for (int32_t il = 0; il < p->plan.n_layer; il++) {
                if (p->plan.n_slots[il] <= 0) {
                    continue;
                }
                struct empanel_layer_stats s;
                empanel_stats_get(p->pool, il, &s);
                text_add(&t, "empanel_%s{model=\"%s\",layer=\"%d\"} ", def->name, p->label, il);
                metric_value(&t, def, &s);
                text_add(&t, "\n");
            }
        }
    }
    text_add(&t, "# HELP empanel_hit_rate Expert hit rate since the model was loaded.\n"
                 "# TYPE empanel_hit_rate gauge\n");
    for (const struct empanel_load * p = g_loads; p != NULL; p = p->next) {
        uint64_t hits = 0, misses = 0;
        for (int32_t il = 0; il < p->plan.n_layer; il++) {
            struct empanel_layer_stats s;
            empanel_stats_get(p->pool, il, &s);
            hits   += s.hits;
            misses += s.misses;
        }
        text_add(&t, "empanel_hit_rate{model=\"%s\"} %.10g\n", p->label,
                 hits + misses > 0 ? (double) hits / (double) (hits + misses) : 0.0);
    }
    pthread_mutex_unlock(&g_loads_lock);
    return t.len;
}
