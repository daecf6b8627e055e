// llama.cpp's own programs (llama-server, llama-cli, llama-bench, llama-perplexity) on slot pools.
//
// `empanel-gguf llama-server ...` plans in Python as for Llama (index, sizing, memory guard),
// writes the plan to a file and runs the program with EMPANEL_PLAN=<that file>. At each load of
// the model the plan names, libllama's program hook (llama-empanel-program.cpp) loads this
// library (the libempanel next to that libllama, or EMPANEL_SIDECAR) and calls
// empanel_program_open before the load and empanel_program_loaded after it; no Python runs in
// the program.
//
// The plan file: one record per line, fields separated by one space, a path always last (it may
// hold spaces). Written by empanel_gguf/program_plan.py; every record is required except order,
// digests and stats, and `end` closes it (a truncated plan is refused).
//
//   empanel-plan <version>
//   model <realpath of the first shard>
//   file <size> <mtime_ns> <path>                 one per shard, in shard order
//   shape <n_layer> <n_expert> <n_expert_used>
//   params <n_threads> <chunk_bytes> <direct_io> <policy> <budget_bytes> <prefetch> <subst_ratio> <verify>
//   guess <depth>                                 0: no gate-ahead guess
//   subst <n_alt>                                 0: no routing substitution
//   preload <0|1>
//   slots <n_slots of layer 0> ... <of layer n_layer-1>
//   tensor <layer> <file> <offset> <expert_size> <name>
//   order <layer> <n> <expert>... <n_uses: 0 or n> <uses>...
//   digests <name> <n_expert> <hex digest>...
//   stats <path>                                  JSON lines, one object per load, at its end
//   end

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

#define EMPANEL_PLAN_VERSION 1

struct program_order {
    int32_t    layer;
    int32_t    n;
    int32_t  * experts;  // [n]
    uint32_t * uses;     // [n] or NULL
};

struct program_digests {
    char     * name;
    int32_t    n;
    uint64_t * digests;  // [n]
};

struct empanel_program {
    struct empanel_pool * pool;
    char     model[PATH_MAX];
    char     label[PATH_MAX];   // model, escaped for a Prometheus label value (/metrics)
    char     stats_path[PATH_MAX];
    int32_t  n_layer;
    int32_t  n_expert;
    int32_t  n_expert_used;
    int32_t  guess_depth;
    int32_t  subst_alt;
    int      preload;
    int32_t  n_masked;    // pools whose waves are masked
    int32_t  n_tensors;
    char  ** tensor_names;          // [n_tensors]
    struct program_order   * orders;   // [n_orders]
    int32_t                  n_orders;
    struct program_digests * digests;  // [n_digests]
    int32_t                  n_digests;
    int32_t * n_slots;    // [n_layer]
    uint64_t  t_open_ns;
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
    for (int32_t i = 0; i < prog->n_tensors; i++) {
        free(prog->tensor_names[i]);
    }
    free(prog->tensor_names);
    for (int32_t i = 0; i < prog->n_orders; i++) {
        free(prog->orders[i].experts);
        free(prog->orders[i].uses);
    }
    free(prog->orders);
    for (int32_t i = 0; i < prog->n_digests; i++) {
        free(prog->digests[i].name);
        free(prog->digests[i].digests);
    }
    free(prog->digests);
    free(prog->n_slots);
    free(prog);
}

// -- parsing --------------------------------------------------------------------------------------

// the plan being read: its file, the current line and where in it the next field starts
struct plan_reader {
    FILE   * f;
    char   * line;
    size_t   cap;
    char   * pos;
    int      line_no;
    const char * path;
};

static int next_line(struct plan_reader * r) {
    ssize_t n = getline(&r->line, &r->cap, r->f);
    if (n < 0) {
        return 0;
    }
    while (n > 0 && (r->line[n - 1] == '\n' || r->line[n - 1] == '\r')) {
        r->line[--n] = '\0';
    }
    r->pos = r->line;
    r->line_no++;
    return 1;
}

// the next space-separated field (NUL-terminated in place), or NULL at the end of the line
static char * next_field(struct plan_reader * r) {
    if (r->pos == NULL || *r->pos == '\0') {
        return NULL;
    }
    char * field = r->pos;
    char * space = strchr(field, ' ');
    if (space != NULL) {
        *space = '\0';
        r->pos = space + 1;
    } else {
        r->pos = field + strlen(field);
    }
    return field;
}

// the rest of the line (a path)
static char * rest_of_line(struct plan_reader * r) {
    char * rest = r->pos;
    r->pos = rest + strlen(rest);
    return rest;
}

static int field_i64(struct plan_reader * r, int64_t * out) {
    char * text = next_field(r);
    if (text == NULL) {
        return -1;
    }
    char * end = NULL;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0') {
        return -1;
    }
    *out = v;
    return 0;
}

static int field_u64(struct plan_reader * r, uint64_t * out, int base) {
    char * text = next_field(r);
    if (text == NULL || text[0] == '-' || text[0] == '+') { // strtoull would wrap a negative
        return -1;
    }
    char * end = NULL;
    errno = 0;
    unsigned long long v = strtoull(text, &end, base);
    if (errno != 0 || end == text || *end != '\0') {
        return -1;
    }
    *out = v;
    return 0;
}

static int field_i32(struct plan_reader * r, int32_t * out, int32_t lo, int32_t hi) {
    int64_t v = 0;
    if (field_i64(r, &v) != 0 || v < lo || v > hi) {
        return -1;
    }
    *out = (int32_t) v;
    return 0;
}

static int field_f32(struct plan_reader * r, float * out) {
    char * text = next_field(r);
    if (text == NULL) {
        return -1;
    }
    char * end = NULL;
    *out = strtof(text, &end);
    return end == text || *end != '\0' ? -1 : 0;
}

// what a plan holds besides the program: the pool's files and tensors, until the pool is made
struct plan_parts {
    char  ** paths;      // [n_paths]
    int32_t  n_paths;
    struct empanel_tensor_desc * tensors; // [n_tensors], names owned by prog->tensor_names
    struct empanel_pool_params   params;
    int      seen;       // enum plan_record bits
};

static void parts_free(struct plan_parts * parts) {
    for (int32_t i = 0; i < parts->n_paths; i++) {
        free(parts->paths[i]);
    }
    free(parts->paths);
    free(parts->tensors);
}

static void * grow(void * ptr, int32_t n, size_t size) {
    return realloc(ptr, (size_t) (n + 1) * size);
}

// the records a plan must hold (struct plan_parts.seen)
enum plan_record {
    PLAN_MODEL   = 1 << 0,
    PLAN_FILE    = 1 << 1,
    PLAN_SHAPE   = 1 << 2,
    PLAN_PARAMS  = 1 << 3,
    PLAN_GUESS   = 1 << 4,
    PLAN_SUBST   = 1 << 5,
    PLAN_PRELOAD = 1 << 6,
    PLAN_SLOTS   = 1 << 7,
    PLAN_TENSOR  = 1 << 8,
    PLAN_REQUIRED = (1 << 9) - 1,
};

// one record of the plan into prog/parts; 0, 1 at `end`, -1 on a bad record (err says which).
// Records of a fixed shape must end where their last field does; shape comes once, before the
// records whose sizes it gives.
static int parse_record(struct plan_reader * r, struct empanel_program * prog, struct plan_parts * parts,
                        char * err, size_t err_size) {
    const char * kind = next_field(r);
    int seen = 0;
    if (kind == NULL) {
        return 0; // blank line
    }
    if (strcmp(kind, "end") == 0) {
        return 1;
    }
    if (strcmp(kind, "model") == 0) {
        snprintf(prog->model, sizeof(prog->model), "%s", rest_of_line(r));
        parts->seen |= PLAN_MODEL;
        return 0;
    }
    if (strcmp(kind, "stats") == 0) {
        snprintf(prog->stats_path, sizeof(prog->stats_path), "%s", rest_of_line(r));
        return 0;
    }
    if (strcmp(kind, "file") == 0) {
        uint64_t size = 0;
        int64_t  mtime_ns = 0;
        if (field_u64(r, &size, 10) != 0 || field_i64(r, &mtime_ns) != 0 || *r->pos == '\0') {
            goto bad;
        }
        const char * path = rest_of_line(r);
        struct stat st;
        if (stat(path, &st) != 0) {
            empanel_format_err(err, err_size, "%s: %s", path, strerror(errno));
            return -1;
        }
#if defined(__APPLE__)
        const int64_t now_ns = (int64_t) st.st_mtimespec.tv_sec * 1000000000 + st.st_mtimespec.tv_nsec;
#else
        const int64_t now_ns = (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
#endif
        if ((uint64_t) st.st_size != size || now_ns != mtime_ns) {
            empanel_format_err(err, err_size, "%s changed since empanel-gguf planned the load (size or mtime); run the "
                    "command again", path);
            return -1;
        }
        char ** paths = grow(parts->paths, parts->n_paths, sizeof(char *));
        if (paths == NULL) {
            goto oom;
        }
        parts->paths = paths;
        if ((parts->paths[parts->n_paths] = strdup(path)) == NULL) {
            goto oom;
        }
        parts->n_paths++;
        parts->seen |= PLAN_FILE;
        return 0;
    }
    if (strcmp(kind, "shape") == 0) {
        if ((parts->seen & PLAN_SHAPE) || field_i32(r, &prog->n_layer, 1, 1 << 16) != 0 ||
            field_i32(r, &prog->n_expert, 1, 1 << 16) != 0 || field_i32(r, &prog->n_expert_used, 1, 1 << 16) != 0) {
            goto bad;
        }
        seen = PLAN_SHAPE;
        goto fixed;
    }
    if (strcmp(kind, "params") == 0) {
        struct empanel_pool_params * p = &parts->params;
        int64_t chunk = 0;
        if (field_i32(r, &p->n_threads, 0, INT32_MAX) != 0 || field_i64(r, &chunk) != 0 || chunk < 0 ||
            chunk > UINT32_MAX || field_i32(r, &p->direct_io, -1, 1) != 0 || field_i32(r, &p->policy, 0, 64) != 0 ||
            field_u64(r, &p->budget_bytes, 10) != 0 || field_i32(r, &p->prefetch, 0, INT32_MAX) != 0 ||
            field_f32(r, &p->subst_ratio) != 0 || !(p->subst_ratio >= 0.0f && p->subst_ratio <= 1.0f) ||
            field_i32(r, &p->verify, 0, 1) != 0) {
            goto bad;
        }
        p->chunk_bytes = (uint32_t) chunk;
        seen = PLAN_PARAMS;
        goto fixed;
    }
    if (strcmp(kind, "guess") == 0) {
        if (field_i32(r, &prog->guess_depth, 0, 1 << 16) != 0) {
            goto bad;
        }
        seen = PLAN_GUESS;
        goto fixed;
    }
    if (strcmp(kind, "subst") == 0) {
        if (field_i32(r, &prog->subst_alt, 0, 1 << 16) != 0) {
            goto bad;
        }
        seen = PLAN_SUBST;
        goto fixed;
    }
    if (strcmp(kind, "preload") == 0) {
        if (field_i32(r, &prog->preload, 0, 1) != 0) {
            goto bad;
        }
        seen = PLAN_PRELOAD;
        goto fixed;
    }
    if (!(parts->seen & PLAN_SHAPE)) { // the records below are sized by it
        empanel_format_err(err, err_size, "%s:%d: '%s' before 'shape'", r->path, r->line_no, kind);
        return -1;
    }
    if (strcmp(kind, "slots") == 0) {
        if (prog->n_slots != NULL) {
            goto bad;
        }
        if ((prog->n_slots = calloc((size_t) prog->n_layer, sizeof(int32_t))) == NULL) {
            goto oom;
        }
        for (int32_t il = 0; il < prog->n_layer; il++) {
            if (field_i32(r, &prog->n_slots[il], -1, prog->n_expert) != 0) {
                goto bad;
            }
        }
        seen = PLAN_SLOTS;
        goto fixed;
    }
    if (strcmp(kind, "tensor") == 0) {
        struct empanel_tensor_desc d = {0};
        if (field_i32(r, &d.layer, 0, prog->n_layer - 1) != 0 || field_i32(r, &d.file, 0, INT32_MAX) != 0 ||
            field_u64(r, &d.offset, 10) != 0 || field_u64(r, &d.expert_size, 10) != 0 || *r->pos == '\0') {
            goto bad;
        }
        struct empanel_tensor_desc * tensors = grow(parts->tensors, prog->n_tensors, sizeof(*parts->tensors));
        if (tensors != NULL) {
            parts->tensors = tensors;
        }
        char ** names = tensors != NULL ? grow(prog->tensor_names, prog->n_tensors, sizeof(char *)) : NULL;
        if (names == NULL) {
            goto oom;
        }
        prog->tensor_names = names;
        if ((names[prog->n_tensors] = strdup(rest_of_line(r))) == NULL) {
            goto oom;
        }
        d.name = names[prog->n_tensors];
        parts->tensors[prog->n_tensors++] = d;
        parts->seen |= PLAN_TENSOR;
        return 0;
    }
    if (strcmp(kind, "order") == 0) {
        struct program_order o = {0};
        int32_t n_uses = 0;
        if (field_i32(r, &o.layer, 0, prog->n_layer - 1) != 0 || field_i32(r, &o.n, 1, prog->n_expert) != 0) {
            goto bad;
        }
        struct program_order * orders = grow(prog->orders, prog->n_orders, sizeof(*prog->orders));
        if (orders == NULL || (o.experts = calloc((size_t) o.n, sizeof(int32_t))) == NULL) {
            if (orders != NULL) {
                prog->orders = orders;
            }
            goto oom;
        }
        prog->orders = orders;
        prog->orders[prog->n_orders++] = o; // owned by prog from here, filled below
        struct program_order * at = &prog->orders[prog->n_orders - 1];
        for (int32_t i = 0; i < at->n; i++) {
            if (field_i32(r, &at->experts[i], 0, prog->n_expert - 1) != 0) {
                goto bad;
            }
        }
        if (field_i32(r, &n_uses, 0, at->n) != 0 || (n_uses != 0 && n_uses != at->n)) {
            goto bad;
        }
        if (n_uses > 0) {
            if ((at->uses = calloc((size_t) n_uses, sizeof(uint32_t))) == NULL) {
                goto oom;
            }
            for (int32_t i = 0; i < n_uses; i++) {
                int32_t u = 0;
                if (field_i32(r, &u, 0, INT32_MAX) != 0) {
                    goto bad;
                }
                at->uses[i] = (uint32_t) u;
            }
        }
        goto fixed;
    }
    if (strcmp(kind, "digests") == 0) {
        const char * name = next_field(r);
        int32_t n = 0;
        if (name == NULL || field_i32(r, &n, 1, prog->n_expert) != 0) {
            goto bad;
        }
        struct program_digests * all = grow(prog->digests, prog->n_digests, sizeof(*prog->digests));
        if (all == NULL) {
            goto oom;
        }
        prog->digests = all;
        struct program_digests * d = &prog->digests[prog->n_digests];
        d->n       = n;
        d->name    = strdup(name);
        d->digests = calloc((size_t) n, sizeof(uint64_t));
        prog->n_digests++; // owned by prog from here (program_free frees a partial one)
        if (d->name == NULL || d->digests == NULL) {
            goto oom;
        }
        for (int32_t i = 0; i < n; i++) {
            if (field_u64(r, &d->digests[i], 16) != 0) {
                goto bad;
            }
        }
        goto fixed;
    }
    empanel_format_err(err, err_size, "%s:%d: unknown record '%s'", r->path, r->line_no, kind);
    return -1;
fixed:
    if (*r->pos != '\0') {
        goto bad; // more fields than the record has
    }
    parts->seen |= seen;
    return 0;
bad:
    empanel_format_err(err, err_size, "%s:%d: a bad '%s' record", r->path, r->line_no, kind);
    return -1;
oom:
    empanel_format_err(err, err_size, "%s:%d: out of memory", r->path, r->line_no);
    return -1;
}

// -- the program's side of a load -----------------------------------------------------------------

struct empanel_program * empanel_program_open(const char * plan_path, const char * model_path, char * err,
                                              size_t err_size) {
    empanel_format_err(err, err_size, "%s", "");
    FILE * f = fopen(plan_path, "r");
    if (f == NULL) {
        empanel_format_err(err, err_size, "the plan %s: %s", plan_path, strerror(errno));
        return NULL;
    }
    struct plan_reader r = { .f = f, .path = plan_path };
    struct empanel_program * prog = calloc(1, sizeof(*prog));
    struct plan_parts parts = {0};
    if (prog == NULL) {
        empanel_format_err(err, err_size, "%s: out of memory", plan_path);
        fclose(f);
        return NULL;
    }
    int ended = 0;
    int64_t version = 0;

    // the header and the model first: a load of another model (a draft model) takes no plan
    const char * magic = next_line(&r) ? next_field(&r) : NULL;
    if (magic == NULL || strcmp(magic, "empanel-plan") != 0 || field_i64(&r, &version) != 0) {
        empanel_format_err(err, err_size, "%s is not an empanel plan", plan_path);
        goto fail;
    }
    if (version != EMPANEL_PLAN_VERSION) {
        empanel_format_err(err, err_size, "%s: plan version %" PRId64 ", this sidecar reads version %d (the package and "
                "its libraries are from different builds)", plan_path, version, EMPANEL_PLAN_VERSION);
        goto fail;
    }
    if (!next_line(&r) || parse_record(&r, prog, &parts, err, err_size) != 0 || prog->model[0] == '\0') {
        empanel_format_err(err, err_size, "%s:%d: the second record must be 'model'", plan_path, r.line_no);
        goto fail;
    }
    char resolved[PATH_MAX];
    if (realpath(model_path, resolved) == NULL || strcmp(resolved, prog->model) != 0) {
        program_free(prog); // not the planned model: it loads as usual
        prog = NULL;
        goto done;
    }
    size_t n_label = 0;
    for (const char * c = prog->model; *c && n_label + 2 < sizeof(prog->label); c++) {
        if (*c == '"' || *c == '\\') {
            prog->label[n_label++] = '\\';
        }
        prog->label[n_label++] = *c == '\n' ? ' ' : *c;
    }
    prog->label[n_label] = '\0';
    while (!ended && next_line(&r)) {
        int rc = parse_record(&r, prog, &parts, err, err_size);
        if (rc < 0) {
            goto fail;
        }
        ended = rc == 1;
    }
    if (!ended || (parts.seen & PLAN_REQUIRED) != PLAN_REQUIRED) {
        empanel_format_err(err, err_size, "%s: incomplete plan (no 'end' record, or a required record missing: "
                           "model, file, shape, params, guess, subst, preload, slots, tensor)", plan_path);
        goto fail;
    }

    prog->pool = empanel_pool_init(&parts.params, (const char * const *) parts.paths, parts.n_paths,
                                   prog->n_layer, prog->n_slots, prog->n_expert, parts.tensors,
                                   prog->n_tensors, err, err_size);
    if (prog->pool == NULL) {
        goto fail;
    }
    for (int32_t i = 0; i < prog->n_digests; i++) {
        const struct program_digests * d = &prog->digests[i];
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
    llama_empanel_set_plan(prog->n_slots, prog->n_layer, (llama_empanel_remap_fn) empanel_remap, prog->pool);
    if (prog->guess_depth > 0) {
        llama_empanel_set_guess((llama_empanel_guess_fn) empanel_guess, prog->guess_depth);
    }
    if (prog->subst_alt > 0) {
        llama_empanel_set_subst((llama_empanel_subst_fn) empanel_subst, prog->subst_alt);
    }
    prog->t_open_ns = empanel_now_ns();
    pthread_mutex_lock(&g_programs_lock);
    prog->next = g_programs;
    g_programs = prog;
    pthread_mutex_unlock(&g_programs_lock);
    goto done;

fail:
    program_free(prog);
    prog = NULL;
    if (err != NULL && err_size > 0 && err[0] == '\0') {
        empanel_format_err(err, err_size, "%s: could not be read", plan_path);
    }
done:
    parts_free(&parts);
    free(r.line);
    fclose(f);
    return prog;
}

int32_t empanel_program_loaded(struct empanel_program * prog, const struct llama_model * model, char * err,
                               size_t err_size) {
    const int32_t n_pools = llama_empanel_n_pools(model);
    if (n_pools != prog->n_tensors) {
        empanel_format_err(err, err_size, "llama.cpp made %d slot pools for the %d routed-expert tensors of %s; this "
                "architecture's loader is not supported yet", n_pools, prog->n_tensors, prog->model);
        return -1;
    }
    prog->n_masked = 0;
    for (int32_t i = 0; i < prog->n_tensors; i++) {
        struct ggml_tensor * pool_tensor = llama_empanel_pool(model, prog->tensor_names[i]);
        if (empanel_pool_bind(prog->pool, prog->tensor_names[i], pool_tensor) != 0) {
            empanel_format_err(err, err_size, "%s", empanel_pool_error(prog->pool));
            return -1;
        }
        prog->n_masked += llama_empanel_pool_masked(pool_tensor) ? 1 : 0;
    }
    for (int32_t i = 0; i < prog->n_orders; i++) {
        const struct program_order * o = &prog->orders[i];
        if (empanel_pool_preload_order(prog->pool, o->layer, o->experts, o->uses, o->n) != 0) {
            empanel_format_err(err, err_size, "layer %d: the profile's preload order was refused", o->layer);
            return -1;
        }
    }
    if (prog->preload) {
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
    fprintf(out, "{\"seconds\": %.3f, \"masked_pools\": %d, \"layers\": {",
            (empanel_now_ns() - prog->t_open_ns) / 1e9, prog->n_masked);
    int first = 1;
    for (int32_t il = 0; il < prog->n_layer; il++) {
        if (prog->n_slots[il] <= 0) {
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
            ", \"verify_ns\": %" PRIu64 ", \"n_slots\": %d, \"n_resident\": %d}",
            first ? "" : ", ", il, s.n_remaps, s.n_ids, s.hits, s.misses, s.bytes_read, s.io_bytes, s.n_reads,
            s.read_ns, s.write_ns, s.copy_bytes, s.remap_ns, s.wait_ns, s.n_waves, s.preloaded, s.guessed,
            s.guess_routed, s.guess_hits, s.prefetched, s.prefetch_used, s.prefetch_wasted, s.substituted,
            s.verified, s.verify_ns, s.n_slots, s.n_resident);
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
    if (prog->stats_path[0] != '\0') {
        FILE * out = fopen(prog->stats_path, "a");
        if (out != NULL) {
            write_stats(prog, out);
            fclose(out);
        } else {
            fprintf(stderr, "empanel: could not write the statistics to %s: %s\n", prog->stats_path, strerror(errno));
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
            for (int32_t il = 0; il < p->n_layer; il++) {
                if (p->n_slots[il] <= 0) {
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
        for (int32_t il = 0; il < p->n_layer; il++) {
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
