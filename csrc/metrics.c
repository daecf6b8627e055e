// What the counters say, written out: the stats file's JSON line of a load (load.c) and the
// Prometheus text (format 0.0.4) of pools' counters. One writer for both faces: llama.cpp's
// programs (llama-server's /metrics through empanel_program_metrics) and `empanel-gguf serve`
// (empanel_gguf/server.py through empanel_metrics_pools and empanel_metrics_label), so a series
// and its labels read the same on either; serve adds only what the sidecar does not know (its
// sampler's recent rates, the guard's memory).

#include "metrics.h"
#include "budget.h"
#include "rpc.h"
#include "stats.h"
#include "state.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

// the pool-level series of the live budget (struct empanel_budget_stats): X(field, type, metric, help)
#define EMPANEL_BUDGET_SERIES(X) \
    X(budget_bytes,     gauge,   "budget_bytes",                 "The live budget of resident expert bytes over all layers.") \
    X(capacity_bytes,   gauge,   "budget_capacity_bytes",        "Expert bytes with every slot full: the highest budget.") \
    X(floor_bytes,      gauge,   "budget_floor_bytes",           "The lowest budget taken: the top-k experts of every MoE layer.") \
    X(resident_bytes,   gauge,   "resident_bytes",               "Expert bytes in the slots now.") \
    X(lowest_bytes,     gauge,   "budget_lowest_bytes",          "The lowest budget since the load.") \
    X(n_changes,        counter, "budget_changes_total",         "Budget moves, by the app or the controller.") \
    X(given_back_bytes, counter, "budget_given_back_bytes_total", "Expert bytes emptied over the budget, pages returned to the kernel.") \
    X(n_shrinks,        counter, "budget_shrinks_total",         "The controller's moves down (memory left below its reserve).") \
    X(n_grows,          counter, "budget_grows_total",           "The controller's moves up (memory free again).") \
    X(max_over_bytes,   gauge,   "budget_max_over_bytes",        "The most resident expert bytes exceeded the budget.") \
    X(elastic,          gauge,   "budget_elastic",               "1 if the controller moves the budget with the memory left (moe_elastic).")

void empanel_metrics_write_json(FILE * out, struct empanel_pool * pool, double seconds, int32_t n_masked,
                                int32_t n_expert_used) {
    uint64_t wire_sent, wire_received, round_trips; // RPC servers (--rpc): this process's wire
    empanel_rpc_wire_bytes(&wire_sent, &wire_received, &round_trips);
    fprintf(out, "{\"seconds\": %.3f, \"masked_pools\": %d, \"n_expert_used\": %d, \"read_io\": \"%s\", "
            "\"wire_sent\": %" PRIu64 ", \"wire_received\": %" PRIu64 ", \"round_trips\": %" PRIu64 ", \"layers\": {",
            seconds, n_masked, n_expert_used, empanel_pool_read_io(pool) == EMPANEL_READ_IO_URING ? "uring" : "threads",
            wire_sent, wire_received, round_trips);
    int first = 1;
    for (int32_t il = 0; il < pool->n_layer; il++) {
        if (pool->layers[il].n_slots <= 0) {
            continue;
        }
        struct empanel_layer_stats s;
        empanel_stats_get(pool, il, &s);
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
    struct empanel_budget_stats b;
    empanel_pool_budget(pool, &b);
    fprintf(out, "}, \"budget\": {");
    const char * sep = "";
#define WRITE_BUDGET(field, type, metric, help) \
    fprintf(out, "%s\"" #field "\": %" PRIu64, sep, (uint64_t) b.field); \
    sep = ", ";
    EMPANEL_BUDGET_SERIES(WRITE_BUDGET)
#undef WRITE_BUDGET
    fprintf(out, ", \"max_shrink_ms\": %.3f}}\n", b.max_shrink_ms);
}

// -- Prometheus text ------------------------------------------------------------------------------

void empanel_metrics_add(struct empanel_text * t, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    char * at = t->len < t->size ? t->buf + t->len : NULL;
    int n = vsnprintf(at, at != NULL ? t->size - t->len : 0, fmt, args);
    va_end(args);
    if (n > 0) {
        t->len += (size_t) n;
    }
}

// a label value as the text format escapes it: backslash, double quote and newline
static void add_label(struct empanel_text * t, const char * value) {
    for (const char * c = value; *c != '\0'; c++) {
        const char * esc = *c == '\\' ? "\\\\" : *c == '"' ? "\\\"" : *c == '\n' ? "\\n" : NULL;
        if (esc != NULL) {
            empanel_metrics_add(t, "%s", esc);
        } else {
            empanel_metrics_add(t, "%c", *c);
        }
    }
}

size_t empanel_metrics_label(const char * value, char * buf, size_t size) {
    struct empanel_text t = { buf, size, 0 };
    if (buf != NULL && size > 0) {
        buf[0] = '\0';
    }
    add_label(&t, value);
    return t.len;
}

// the per-layer series: the counters of EMPANEL_LAYER_COUNTERS that name a metric
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

static void metric_value(struct empanel_text * t, const struct metric_def * m, const struct empanel_layer_stats * s) {
    uint64_t value;
    memcpy(&value, (const char *) s + m->offset, sizeof(value));
    if (m->ns) {
        empanel_metrics_add(t, "%.9f", value / 1e9);
    } else {
        empanel_metrics_add(t, "%" PRIu64, value); // counts as integers: bytes pass 2^53 in long runs
    }
}

void empanel_metrics_families(struct empanel_text * t, struct empanel_pool * const * pools,
                              const char * const * models, int32_t n) {
    const struct metric_def metrics[] = { EMPANEL_LAYER_COUNTERS(METRIC_DEF) };
    const int32_t n_metrics = (int32_t) (sizeof(metrics) / sizeof(metrics[0]));
    for (int32_t m = 0; m < n_metrics; m++) {
        const struct metric_def * def = &metrics[m];
        if (def->name[0] == '\0') {
            continue;
        }
        empanel_metrics_add(t, "# HELP empanel_%s %s\n# TYPE empanel_%s %s\n", def->name, def->help, def->name,
                            def->type);
        for (int32_t p = 0; p < n; p++) {
            for (int32_t il = 0; il < pools[p]->n_layer; il++) {
                if (pools[p]->layers[il].n_slots <= 0) {
                    continue;
                }
                struct empanel_layer_stats s;
                empanel_stats_get(pools[p], il, &s);
                empanel_metrics_add(t, "empanel_%s{model=\"", def->name);
                add_label(t, models[p]);
                empanel_metrics_add(t, "\",layer=\"%d\"} ", il);
                metric_value(t, def, &s);
                empanel_metrics_add(t, "\n");
            }
        }
    }
    // the budget's series, one per model
#define BUDGET_FAMILY(field, type, metric, help) \
    empanel_metrics_add(t, "# HELP empanel_" metric " " help "\n# TYPE empanel_" metric " " #type "\n"); \
    for (int32_t p = 0; p < n; p++) { \
        struct empanel_budget_stats b; \
        empanel_pool_budget(pools[p], &b); \
        empanel_metrics_add(t, "empanel_" metric "{model=\""); \
        add_label(t, models[p]); \
        empanel_metrics_add(t, "\"} %" PRIu64 "\n", (uint64_t) b.field); \
    }
    EMPANEL_BUDGET_SERIES(BUDGET_FAMILY)
#undef BUDGET_FAMILY
}

size_t empanel_metrics_pools(struct empanel_pool * const * pools, const char * const * models, int32_t n,
                             char * buf, size_t size) {
    struct empanel_text t = { buf, size, 0 };
    if (buf != NULL && size > 0) {
        buf[0] = '\0';
    }
    // the models with pools, for the families (pools[i] NULL: a model without them)
    struct empanel_pool * with[EMPANEL_METRICS_MAX_MODELS];
    const char *          named[EMPANEL_METRICS_MAX_MODELS];
    int32_t               n_with = 0;
    empanel_metrics_add(&t, "# HELP empanel_slot_pools 1 if the model runs with expert slot pools.\n"
                            "# TYPE empanel_slot_pools gauge\n");
    for (int32_t p = 0; p < n; p++) {
        empanel_metrics_add(&t, "empanel_slot_pools{model=\"");
        add_label(&t, models[p]);
        empanel_metrics_add(&t, "\"} %d\n", pools[p] != NULL);
        if (pools[p] != NULL && n_with < EMPANEL_METRICS_MAX_MODELS) {
            with[n_with]    = pools[p];
            named[n_with++] = models[p];
        }
    }
    if (n_with > 0) {
        empanel_metrics_families(&t, with, named, n_with);
        empanel_metrics_add(&t, "# HELP empanel_hit_rate Expert hit rate since the model was loaded.\n"
                                "# TYPE empanel_hit_rate gauge\n");
    }
    for (int32_t p = 0; p < n_with; p++) {
        uint64_t hits = 0, misses = 0;
        for (int32_t il = 0; il < with[p]->n_layer; il++) {
            struct empanel_layer_stats s;
            empanel_stats_get(with[p], il, &s);
            hits   += s.hits;
            misses += s.misses;
        }
        empanel_metrics_add(&t, "empanel_hit_rate{model=\"");
        add_label(&t, named[p]);
        empanel_metrics_add(&t, "\"} %.10g\n", hits + misses > 0 ? (double) hits / (double) (hits + misses) : 0.0);
    }
    empanel_metrics_add(&t, "# HELP empanel_rpc_reloads_total Loads anew after a lost RPC host answered again.\n"
                            "# TYPE empanel_rpc_reloads_total counter\n"
                            "empanel_rpc_reloads_total %" PRIu64 "\n", empanel_rpc_hosts_back_count());
    return t.len;
}
