// llama.cpp's own programs (llama-server, llama-cli, llama-bench, llama-perplexity) on slot pools.
//
// `empanel-gguf llama-server ...` plans in Python as for Llama (index, sizing, memory guard),
// writes the plan to a file and runs the program with EMPANEL_PLAN=<that file>. At each load of
// the model the plan names, libllama's program hook (llama-empanel-program.cpp) loads this
// library (the libempanel next to that libllama, or EMPANEL_SIDECAR) and calls
// empanel_program_open before the load and empanel_program_loaded after it; no Python runs in
// the program.
//
// The plan file and its records: plan.c.

#include "empanel.h"
#include "empanel-impl.h"

#include "llama-empanel.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct empanel_program {
    struct empanel_pool * pool;
    struct empanel_plan   plan;
    char     label[PATH_MAX];   // plan.model, escaped for a Prometheus label value (/metrics)
    int32_t  n_masked;          // pools whose waves are masked
    uint64_t t_open_ns;
    struct empanel_program * next;  // open programs (metrics)
};

static pthread_mutex_t          g_programs_lock = PTHREAD_MUTEX_INITIALIZER;
static struct empanel_program * g_programs      = NULL;

static void program_free(struct empanel_program * prog) {
    if (prog == NULL) {
        return;
    }
    if (prog->pool != NULL) {
        empanel_pool_free(prog->pool);
    }
    empanel_plan_free(&prog->plan);
    free(prog);
}

// -- the program's side of a load -----------------------------------------------------------------

struct empanel_program * empanel_program_open(const char * plan_path, const char * model_path, char * err,
                                              size_t err_size) {
    struct empanel_program * prog = calloc(1, sizeof(*prog));
    if (prog == NULL) {
        empanel_format_err(err, err_size, "%s: out of memory", plan_path);
        return NULL;
    }
    const int rc = empanel_plan_read(plan_path, model_path, &prog->plan, err, err_size);
    if (rc <= 0) {
        free(prog); // 0: not the planned model, which loads as usual (err is "")
        return NULL;
    }
    struct empanel_plan * plan = &prog->plan;
    size_t n_label = 0;
    for (const char * c = plan->model; *c && n_label + 2 < sizeof(prog->label); c++) {
        if (*c == '"' || *c == '\\') {
            prog->label[n_label++] = '\\';
        }
        prog->label[n_label++] = *c == '\n' ? ' ' : *c;
    }
    prog->label[n_label] = '\0';

    prog->pool = empanel_pool_init(&plan->params, (const char * const *) plan->paths, plan->n_paths,
                                   plan->n_layer, plan->n_slots, plan->n_expert, plan->tensors,
                                   plan->n_tensors, err, err_size);
    if (prog->pool == NULL) {
        goto fail;
    }
    for (int32_t i = 0; i < plan->n_digests; i++) {
        const struct empanel_plan_digests * d = &plan->digests[i];
        if (empanel_pool_set_digests(prog->pool, d->name, d->digests, d->n) != 0) {
            empanel_format_err(err, err_size, "%s: digests for %s refused (unknown tensor, or the plan does not verify)",
                    plan_path, d->name);
            goto fail;
        }
    }
    if (empanel_pool_notice(prog->pool)[0] != '\0') {
        fprintf(stderr, "empanel: %s\n", empanel_pool_notice(prog->pool));
    }

    // the plan of the load that follows on this thread (libllama clears it after the load)
    llama_empanel_set_plan(plan->n_slots, plan->n_layer, (llama_empanel_remap_fn) empanel_remap, prog->pool);
    if (plan->guess_depth > 0) {
        llama_empanel_set_guess((llama_empanel_guess_fn) empanel_guess, plan->guess_depth);
    }
    if (plan->subst_alt > 0) {
        llama_empanel_set_subst((llama_empanel_subst_fn) empanel_subst, plan->subst_alt);
    }
    prog->t_open_ns = empanel_now_ns();
    pthread_mutex_lock(&g_programs_lock);
    prog->next = g_programs;
    g_programs = prog;
    pthread_mutex_unlock(&g_programs_lock);
    return prog;

fail:
    program_free(prog);
    return NULL;
}

int32_t empanel_program_loaded(struct empanel_program * prog, const struct llama_model * model, char * err,
                               size_t err_size) {
    const int32_t n_pools = llama_empanel_n_pools(model);
    if (n_pools != prog->plan.n_tensors) {
        empanel_format_err(err, err_size, "llama.cpp made %d slot pools for the %d routed-expert tensors of %s; this "
                "architecture's loader is not supported yet", n_pools, prog->plan.n_tensors, prog->plan.model);
        return -1;
    }
    prog->n_masked = 0;
    for (int32_t i = 0; i < prog->plan.n_tensors; i++) {
        struct ggml_tensor * pool_tensor = llama_empanel_pool(model, prog->plan.tensor_names[i]);
        if (empanel_pool_bind(prog->pool, prog->plan.tensor_names[i], pool_tensor) != 0) {
            empanel_format_err(err, err_size, "%s", empanel_pool_error(prog->pool));
            return -1;
        }
        prog->n_masked += llama_empanel_pool_masked(pool_tensor) ? 1 : 0;
    }
    for (int32_t i = 0; i < prog->plan.n_orders; i++) {
        const struct empanel_plan_order * o = &prog->plan.orders[i];
        if (empanel_pool_preload_order(prog->pool, o->layer, o->experts, o->uses, o->n) != 0) {
            empanel_format_err(err, err_size, "layer %d: the profile's preload order was refused", o->layer);
            return -1;
        }
    }
    if (prog->plan.preload) {
        const uint64_t t0 = empanel_now_ns();
        const int64_t n = empanel_pool_preload(prog->pool);
        if (n < 0) {
            empanel_format_err(err, err_size, "preloading experts: %s", empanel_pool_error(prog->pool));
            return -1;
        }
        fprintf(stderr, "empanel: preloaded %" PRId64 " experts (%.1f MiB) into the pools in %.2f s\n", n,
                empanel_pool_resident_bytes(prog->pool) / 1048576.0, (empanel_now_ns() - t0) / 1e9);
    }
    return 0;
}

struct empanel_pool * empanel_program_pool(struct empanel_program * prog) {
    return prog->pool;
}

// the counters of every paged layer as one JSON object (a line of the stats file)
static void write_stats(const struct empanel_program * prog, FILE * out) {
    uint64_t wire_sent, wire_received, round_trips; // RPC servers (--rpc): this process's wire
    empanel_rpc_wire_bytes(&wire_sent, &wire_received, &round_trips);
    fprintf(out, "{\"seconds\": %.3f, \"masked_pools\": %d, \"wire_sent\": %" PRIu64 ", \"wire_received\": %" PRIu64
            ", \"round_trips\": %" PRIu64 ", \"layers\": {", (empanel_now_ns() - prog->t_open_ns) / 1e9, prog->n_masked,
            wire_sent, wire_received, round_trips);
    int first = 1;
    for (int32_t il = 0; il < prog->plan.n_layer; il++) {
        if (prog->plan.n_slots[il] <= 0) {
            continue;
        }
        struct empanel_layer_stats s;
        empanel_stats_get(prog->pool, il, &s);
        fprintf(out,
            "%s\"%d\": {\"n_remaps\": %" PRIu64 ", \"n_ids\": %" PRIu64 ", \"hits\": %" PRIu64 ", \"misses\": %" PRIu64
            ", \"bytes_read\": %" PRIu64 ", \"io_bytes\": %" PRIu64 ", \"n_reads\": %" PRIu64 ", \"read_ns\": %" PRIu64
            ", \"write_ns\": %" PRIu64 ", \"copy_bytes\": %" PRIu64 ", \"remap_ns\": %" PRIu64 ", \"wait_ns\": %" PRIu64
            ", \"n_waves\": %" PRIu64 ", \"preloaded\": %" PRIu64 ", \"guessed\": %" PRIu64 ", \"guess_routed\": %" PRIu64
            ", \"guess_hits\": %" PRIu64 ", \"prefetched\": %" PRIu64 ", \"prefetch_used\": %" PRIu64
            ", \"prefetch_wasted\": %" PRIu64 ", \"substituted\": %" PRIu64 ", \"verified\": %" PRIu64
            ", \"verify_ns\": %" PRIu64 ", \"remote_by_hash\": %" PRIu64 ", \"n_slots\": %d, \"n_resident\": %d}",
            first ? "" : ", ", il, s.n_remaps, s.n_ids, s.hits, s.misses, s.bytes_read, s.io_bytes, s.n_reads,
            s.read_ns, s.write_ns, s.copy_bytes, s.remap_ns, s.wait_ns, s.n_waves, s.preloaded, s.guessed,
            s.guess_routed, s.guess_hits, s.prefetched, s.prefetch_used, s.prefetch_wasted, s.substituted,
            s.verified, s.verify_ns, s.remote_by_hash, s.n_slots, s.n_resident);
        first = 0;
    }
    fprintf(out, "}}\n");
}

void empanel_program_close(struct empanel_program * prog) {
    if (prog == NULL) {
        return;
    }
    pthread_mutex_lock(&g_programs_lock);
    for (struct empanel_program ** p = &g_programs; *p != NULL; p = &(*p)->next) {
        if (*p == prog) {
            *p = prog->next;
            break;
        }
    }
    pthread_mutex_unlock(&g_programs_lock);
    if (prog->plan.stats_path[0] != '\0') {
        FILE * out = fopen(prog->plan.stats_path, "a");
        if (out != NULL) {
            write_stats(prog, out);
            fclose(out);
        } else {
            fprintf(stderr, "empanel: could not write the statistics to %s: %s\n", prog->plan.stats_path, strerror(errno));
        }
    }
    program_free(prog);
}

// -- Prometheus text of the open programs (llama-server's /metrics) -------------------------------

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

// the counters empanel-gguf serve's /metrics names too (server.py), per layer
struct metric_def {
    const char * name;
    const char * type;
    const char * help;
};

static const struct metric_def k_metrics[] = {
    { "empanel_expert_hits_total",   "counter", "Distinct experts of a micro-batch found in a slot."        },
    { "empanel_expert_misses_total", "counter", "Distinct experts of a micro-batch read from the model file." },
    { "empanel_read_bytes_total",    "counter", "Bytes of experts read from the model file."                 },
    { "empanel_read_seconds_total",  "counter", "Time spent reading experts."                                },
    { "empanel_remap_seconds_total", "counter", "Time spent in the remap step."                              },
    { "empanel_remaps_total",        "counter", "Remap calls (one per micro-batch and layer)."              },
    { "empanel_slots",               "gauge",   "Expert slots of the layer's pool."                         },
    { "empanel_slots_resident",      "gauge",   "Slots holding an expert."                                  },
};

// metric m of a layer as Prometheus text: counts as integers (bytes pass 2^53 in long runs), times in s
static void metric_value(struct text_out * t, int32_t m, const struct empanel_layer_stats * s) {
    switch (m) {
        case 0:  text_add(t, "%" PRIu64, s->hits);          break;
        case 1:  text_add(t, "%" PRIu64, s->misses);        break;
        case 2:  text_add(t, "%" PRIu64, s->bytes_read);    break;
        case 3:  text_add(t, "%.9f", s->read_ns / 1e9);     break;
        case 4:  text_add(t, "%.9f", s->remap_ns / 1e9);    break;
        case 5:  text_add(t, "%" PRIu64, s->n_remaps);      break;
        case 6:  text_add(t, "%d", s->n_slots);             break;
        default: text_add(t, "%d", s->n_resident);          break;
    }
}

size_t empanel_program_metrics(char * buf, size_t size) {
    struct text_out t = { buf, size, 0 };
    if (buf != NULL && size > 0) {
        buf[0] = '\0';
    }
    pthread_mutex_lock(&g_programs_lock);
    const int32_t n_metrics = (int32_t) (sizeof(k_metrics) / sizeof(k_metrics[0]));
    text_add(&t, "# HELP empanel_slot_pools 1 if the model runs with expert slot pools.\n"
                 "# TYPE empanel_slot_pools gauge\n");
    for (const struct empanel_program * p = g_programs; p != NULL; p = p->next) {
        text_add(&t, "empanel_slot_pools{model=\"%s\"} 1\n", p->label);
    }
    for (int32_t m = 0; m < n_metrics; m++) {
        text_add(&t, "# HELP %s %s\n# TYPE %s %s\n", k_metrics[m].name, k_metrics[m].help, k_metrics[m].name,
                 k_metrics[m].type);
        for (const struct empanel_program * p = g_programs; p != NULL; p = p->next) {
            for (int32_t il = 0; il < p->plan.n_layer; il++) {
                if (p->plan.n_slots[il] <= 0) {
                    continue;
                }
                struct empanel_layer_stats s;
                empanel_stats_get(p->pool, il, &s);
                text_add(&t, "%s{model=\"%s\",layer=\"%d\"} ", k_metrics[m].name, p->label, il);
                metric_value(&t, m, &s);
                text_add(&t, "\n");
            }
        }
    }
    text_add(&t, "# HELP empanel_hit_rate Expert hit rate since the model was loaded.\n"
                 "# TYPE empanel_hit_rate gauge\n");
    for (const struct empanel_program * p = g_programs; p != NULL; p = p->next) {
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
    pthread_mutex_unlock(&g_programs_lock);
    return t.len;
}
