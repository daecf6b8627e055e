// The plan of a load written down (empanel_gguf/planning/plan_file.py), read here into a struct
// empanel_plan: from a file for llama.cpp's programs (EMPANEL_PLAN), from memory for a load in
// the Python process. Both then go through load.c.
//
// One record per line, fields separated by one space, a path always last (it may hold spaces).
// Every record is required except pin, host-cache, io, elastic, memory, order, digests and stats (and tensor when no layer is paged:
// a load that only traces routing), and `end` closes it (a truncated plan is refused).
//
//   empanel-plan <version>
//   model <realpath of the first shard>
//   file <size> <mtime_ns> <path>                 one per shard, in shard order
//   shape <n_layer> <n_expert> <n_expert_used>
//   params <n_threads> <chunk_bytes> <direct_io> <policy> <budget_bytes> <prefetch> <subst_ratio> <verify>
//   guess <depth>                                 0: no gate-ahead guess
//   subst <n_alt>                                 0: no routing substitution
//   preload <0|1>
//   pin <0|1>                                     optional: pools that hold every expert run stock's
//                                                 graph (expert e in slot e; needs preload 1)
//   host-cache <bytes>                            optional: the host-RAM tier of device pools
//                                                 (host_cache.c); 0 or absent: none
//   io <read_io> <queue_depth>                    optional: enum empanel_read_io and the io_uring
//                                                 depth (0: defaults); absent: auto
//   slots <n_slots of layer 0> ... <of layer n_layer-1>
//   tensor <layer> <file> <offset> <expert_size> <name>
//   order <layer> <n> <expert>... <n_uses: 0 or n> <uses>...
//   digests <name> <n_expert> <hex digest>...
//   elastic <reserve_bytes> <interval_ms>         optional: the controller moves the budget with the
//                                                 memory left (pressure.c); absent: it stays
//   memory <source> <role> <key|-> <path>         optional: a file the controller reads; source
//                                                 0..EMPANEL_MAX_MEMORY_SOURCES-1, role limit|high|
//                                                 usage|stat|events|available (stat and available
//                                                 name the key read in the file)
//   stats <path>                                  JSON lines, one object per load, at its end
//   end

#include "plan_file.h"
#include "util.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

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

static void * grow(void * ptr, int32_t n, size_t size) {
    return realloc(ptr, (size_t) (n + 1) * size);
}

// the records a plan must hold (struct empanel_plan.seen)
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

// what a record's parser found (the caller writes the message for BAD and OOM)
enum record_result {
    RECORD_FIXED,  // read; the line must end where its last field does
    RECORD_LINE,   // read, to the end of the line
    RECORD_BAD,    // a bad record
    RECORD_OOM,    // out of memory
    RECORD_FAILED, // refused, err says why
};

static enum record_result parse_model(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    snprintf(plan->model, sizeof(plan->model), "%s", rest_of_line(r));
    return RECORD_LINE;
}

static enum record_result parse_stats(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    snprintf(plan->stats_path, sizeof(plan->stats_path), "%s", rest_of_line(r));
    return RECORD_LINE;
}

// file SIZE MTIME_NS PATH: a shard as it was at plan time
static enum record_result parse_file(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    uint64_t size = 0;
    int64_t  mtime_ns = 0;
    if (field_u64(r, &size, 10) != 0 || field_i64(r, &mtime_ns) != 0 || *r->pos == '\0') {
        return RECORD_BAD;
    }
    const char * path = rest_of_line(r);
    struct stat st;
    if (stat(path, &st) != 0) {
        empanel_util_format_err(err, err_size, "%s: %s", path, strerror(errno));
        return RECORD_FAILED;
    }
#if defined(__APPLE__)
    const int64_t now_ns = (int64_t) st.st_mtimespec.tv_sec * 1000000000 + st.st_mtimespec.tv_nsec;
#else
    const int64_t now_ns = (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
#endif
    if ((uint64_t) st.st_size != size || now_ns != mtime_ns) {
        empanel_util_format_err(err, err_size, "%s changed since empanel-gguf planned the load (size or mtime); run the "
                "command again", path);
        return RECORD_FAILED;
    }
    char ** paths = grow(plan->paths, plan->n_paths, sizeof(char *));
    if (paths == NULL) {
        return RECORD_OOM;
    }
    plan->paths = paths;
    uint64_t * sizes = grow(plan->file_sizes, plan->n_paths, sizeof(uint64_t));
    if (sizes == NULL) {
        return RECORD_OOM;
    }
    plan->file_sizes = sizes;
    plan->file_sizes[plan->n_paths] = size;
    if ((plan->paths[plan->n_paths] = strdup(path)) == NULL) {
        return RECORD_OOM;
    }
    plan->n_paths++;
    return RECORD_LINE;
}

// shape N_LAYER N_EXPERT N_EXPERT_USED (once)
static enum record_result parse_shape(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    const int again = (plan->seen & PLAN_SHAPE) != 0;
    return again || field_i32(r, &plan->n_layer, 1, 1 << 16) != 0 || field_i32(r, &plan->n_expert, 1, 1 << 16) != 0 ||
           field_i32(r, &plan->n_expert_used, 1, 1 << 16) != 0 ? RECORD_BAD : RECORD_FIXED;
}

// params THREADS CHUNK DIRECT_IO POLICY BUDGET PREFETCH SUBST_RATIO VERIFY
static enum record_result parse_params(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    struct empanel_pool_params * p = &plan->params;
    int64_t chunk = 0;
    if (field_i32(r, &p->n_threads, 0, EMPANEL_MAX_READ_THREADS) != 0 || field_i64(r, &chunk) != 0 || chunk < 0 ||
        chunk > EMPANEL_MAX_CHUNK_BYTES || field_i32(r, &p->direct_io, -1, 1) != 0 || field_i32(r, &p->policy, 0, 64) != 0 ||
        field_u64(r, &p->budget_bytes, 10) != 0 || field_i32(r, &p->prefetch, 0, INT32_MAX) != 0 ||
        field_f32(r, &p->subst_ratio) != 0 || !(p->subst_ratio >= 0.0f && p->subst_ratio <= 1.0f) ||
        field_i32(r, &p->verify, 0, 1) != 0) {
        return RECORD_BAD;
    }
    p->chunk_bytes = (uint32_t) chunk;
    return RECORD_FIXED;
}

static enum record_result parse_guess(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    return field_i32(r, &plan->guess_depth, 0, 1 << 16) != 0 ? RECORD_BAD : RECORD_FIXED;
}

static enum record_result parse_subst(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    return field_i32(r, &plan->subst_alt, 0, 1 << 16) != 0 ? RECORD_BAD : RECORD_FIXED;
}

static enum record_result parse_preload(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    return field_i32(r, &plan->preload, 0, 1) != 0 ? RECORD_BAD : RECORD_FIXED;
}

static enum record_result parse_pin(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    return field_i32(r, &plan->pinned, 0, 1) != 0 ? RECORD_BAD : RECORD_FIXED;
}

static enum record_result parse_io(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    return field_i32(r, &plan->params.read_io, EMPANEL_READ_IO_AUTO, EMPANEL_READ_IO_URING) != 0 ||
           field_i32(r, &plan->params.queue_depth, 0, EMPANEL_MAX_QUEUE_DEPTH) != 0 ? RECORD_BAD : RECORD_FIXED;
}

// prompt-ahead 0|1 (optional: 0 where absent)
static enum record_result parse_prompt_ahead(struct plan_reader * r, struct empanel_plan * plan, char * err,
                                             size_t err_size) {
    return field_i32(r, &plan->params.prompt_ahead, 0, 1) != 0 ? RECORD_BAD : RECORD_FIXED;
}

static enum record_result parse_host_cache(struct plan_reader * r, struct empanel_plan * plan, char * err,
                                           size_t err_size) {
    return field_u64(r, &plan->host_cache_bytes, 10) != 0 ? RECORD_BAD : RECORD_FIXED;
}

// slots N_0 .. N_{n_layer-1} (once)
static enum record_result parse_slots(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    if (plan->n_slots != NULL) {
        return RECORD_BAD;
    }
    if ((plan->n_slots = calloc((size_t) plan->n_layer, sizeof(int32_t))) == NULL) {
        return RECORD_OOM;
    }
    for (int32_t il = 0; il < plan->n_layer; il++) {
        if (field_i32(r, &plan->n_slots[il], -1, plan->n_expert) != 0) {
            return RECORD_BAD;
        }
    }
    return RECORD_FIXED;
}

// tensor LAYER FILE OFFSET EXPERT_SIZE NAME
static enum record_result parse_tensor(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    struct empanel_tensor_desc d = {0};
    if (field_i32(r, &d.layer, 0, plan->n_layer - 1) != 0 || field_i32(r, &d.file, 0, plan->n_paths - 1) != 0 ||
        field_u64(r, &d.offset, 10) != 0 || field_u64(r, &d.expert_size, 10) != 0 || d.expert_size == 0 ||
        *r->pos == '\0') {
        return RECORD_BAD;
    }
    // the experts lie inside their file (which the 'file' record sized): no sum below wraps
    const uint64_t file_size = plan->file_sizes[d.file];
    if (d.offset > file_size || d.expert_size > (file_size - d.offset) / (uint64_t) plan->n_expert) {
        empanel_util_format_err(err, err_size, "%s:%d: tensor %s: %d experts of %llu bytes at offset %llu lie outside "
                                "its file (%llu bytes)", r->path, r->line_no, rest_of_line(r), plan->n_expert,
                                (unsigned long long) d.expert_size, (unsigned long long) d.offset,
                                (unsigned long long) file_size);
        return RECORD_FAILED;
    }
    struct empanel_tensor_desc * tensors = grow(plan->tensors, plan->n_tensors, sizeof(*plan->tensors));
    if (tensors != NULL) {
        plan->tensors = tensors;
    }
    char ** names = tensors != NULL ? grow(plan->tensor_names, plan->n_tensors, sizeof(char *)) : NULL;
    if (names == NULL) {
        return RECORD_OOM;
    }
    plan->tensor_names = names;
    if ((names[plan->n_tensors] = strdup(rest_of_line(r))) == NULL) {
        return RECORD_OOM;
    }
    d.name = names[plan->n_tensors];
    plan->tensors[plan->n_tensors++] = d;
    return RECORD_LINE;
}

// order LAYER N EXPERT_1 .. EXPERT_N N_USES [USES_1 .. USES_N]
static enum record_result parse_order(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    struct empanel_plan_order o = {0};
    int32_t n_uses = 0;
    if (field_i32(r, &o.layer, 0, plan->n_layer - 1) != 0 || field_i32(r, &o.n, 1, plan->n_expert) != 0) {
        return RECORD_BAD;
    }
    struct empanel_plan_order * orders = grow(plan->orders, plan->n_orders, sizeof(*plan->orders));
    if (orders == NULL || (o.experts = calloc((size_t) o.n, sizeof(int32_t))) == NULL) {
        if (orders != NULL) {
            plan->orders = orders;
        }
        return RECORD_OOM;
    }
    plan->orders = orders;
    plan->orders[plan->n_orders++] = o; // owned by plan from here, filled below
    struct empanel_plan_order * at = &plan->orders[plan->n_orders - 1];
    for (int32_t i = 0; i < at->n; i++) {
        if (field_i32(r, &at->experts[i], 0, plan->n_expert - 1) != 0) {
            return RECORD_BAD;
        }
    }
    if (field_i32(r, &n_uses, 0, at->n) != 0 || (n_uses != 0 && n_uses != at->n)) {
        return RECORD_BAD;
    }
    if (n_uses > 0) {
        if ((at->uses = calloc((size_t) n_uses, sizeof(uint32_t))) == NULL) {
            return RECORD_OOM;
        }
        for (int32_t i = 0; i < n_uses; i++) {
            int32_t u = 0;
            if (field_i32(r, &u, 0, INT32_MAX) != 0) {
                return RECORD_BAD;
            }
            at->uses[i] = (uint32_t) u;
        }
    }
    return RECORD_FIXED;
}

// digests NAME N DIGEST_1 .. DIGEST_N (hex)
static enum record_result parse_digests(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    const char * name = next_field(r);
    int32_t n = 0;
    if (name == NULL || field_i32(r, &n, 1, plan->n_expert) != 0) {
        return RECORD_BAD;
    }
    struct empanel_plan_digests * all = grow(plan->digests, plan->n_digests, sizeof(*plan->digests));
    if (all == NULL) {
        return RECORD_OOM;
    }
    plan->digests = all;
    struct empanel_plan_digests * d = &plan->digests[plan->n_digests];
    d->n       = n;
    d->name    = strdup(name);
    d->digests = calloc((size_t) n, sizeof(uint64_t));
    plan->n_digests++; // owned by plan from here (empanel_plan_free frees a partial one)
    if (d->name == NULL || d->digests == NULL) {
        return RECORD_OOM;
    }
    for (int32_t i = 0; i < n; i++) {
        if (field_u64(r, &d->digests[i], 16) != 0) {
            return RECORD_BAD;
        }
    }
    return RECORD_FIXED;
}

// elastic RESERVE INTERVAL_MS
static enum record_result parse_elastic(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    plan->elastic = 1;
    if (field_u64(r, &plan->reserve_bytes, 10) != 0 || field_i32(r, &plan->interval_ms, 1, 60000) != 0) {
        return RECORD_BAD;
    }
    if (plan->reserve_bytes == 0 || plan->reserve_bytes > EMPANEL_MAX_RESERVE_BYTES) {
        empanel_util_format_err(err, err_size, "%s:%d: a reserve of %llu bytes: the memory the controller keeps "
                                "free lies in 1 .. %llu", r->path, r->line_no, (unsigned long long) plan->reserve_bytes,
                                (unsigned long long) EMPANEL_MAX_RESERVE_BYTES);
        return RECORD_FAILED;
    }
    return RECORD_FIXED;
}

// memory SOURCE ROLE KEY PATH
static enum record_result parse_memory(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    static const char * roles[PLAN_MEMORY_ROLES] = { "limit", "high", "usage", "stat", "events", "available" };
    int32_t source = 0;
    if (field_i32(r, &source, 0, EMPANEL_MAX_MEMORY_SOURCES - 1) != 0) {
        return RECORD_BAD;
    }
    const char * role = next_field(r);
    int k = 0;
    while (role != NULL && k < PLAN_MEMORY_ROLES && strcmp(role, roles[k]) != 0) {
        k++;
    }
    const char * key = k < PLAN_MEMORY_ROLES ? next_field(r) : NULL;
    if (key == NULL || *r->pos == '\0') {
        return RECORD_BAD;
    }
    struct empanel_plan_memory * m = &plan->memory[source];
    if (k == PLAN_MEMORY_STAT) {
        snprintf(m->stat_key, sizeof(m->stat_key), "%s", key);
    } else if (k == PLAN_MEMORY_AVAILABLE) {
        snprintf(m->available_key, sizeof(m->available_key), "%s", key);
    }
    free(m->path[k]);
    if ((m->path[k] = strdup(rest_of_line(r))) == NULL) {
        return RECORD_OOM;
    }
    plan->n_memory = source + 1 > plan->n_memory ? source + 1 : plan->n_memory;
    return RECORD_LINE;
}

typedef enum record_result (*record_parser)(struct plan_reader * r, struct empanel_plan * plan, char * err,
                                             size_t err_size);

// every record kind: its parser, the bit it sets in plan->seen (0: none), whether it comes after
// 'shape' (which sizes it)
static const struct {
    const char  * kind;
    record_parser parse;
    int           seen;
    int           sized;
} g_records[] = {
    { "model",      parse_model,      PLAN_MODEL,   0 },
    { "stats",      parse_stats,      0,            0 },
    { "file",       parse_file,       PLAN_FILE,    0 },
    { "shape",      parse_shape,      PLAN_SHAPE,   0 },
    { "params",     parse_params,     PLAN_PARAMS,  0 },
    { "guess",      parse_guess,      PLAN_GUESS,   0 },
    { "subst",      parse_subst,      PLAN_SUBST,   0 },
    { "preload",    parse_preload,    PLAN_PRELOAD, 0 },
    { "pin",        parse_pin,        0,            0 },
    { "host-cache", parse_host_cache, 0,            0 },
    { "io",         parse_io,         0,            0 },
    { "prompt-ahead", parse_prompt_ahead, 0,        0 },
    { "elastic",    parse_elastic,    0,            0 },
    { "memory",     parse_memory,     0,            0 },
    { "slots",      parse_slots,      PLAN_SLOTS,   1 },
    { "tensor",     parse_tensor,     PLAN_TENSOR,  1 },
    { "order",      parse_order,      0,            1 },
    { "digests",    parse_digests,    0,            1 },
};

// one record of the plan into plan; 0, 1 at `end`, -1 on a bad record (err says which).
// Records of a fixed shape must end where their last field does; shape comes once, before the
// records whose sizes it gives.
static int parse_record(struct plan_reader * r, struct empanel_plan * plan, char * err, size_t err_size) {
    const char * kind = next_field(r);
    if (kind == NULL) {
        return 0; // blank line
    }
    if (strcmp(kind, "end") == 0) {
        return 1;
    }
    const int n_kinds = (int) (sizeof(g_records) / sizeof(g_records[0]));
    int k = 0;
    while (k < n_kinds && strcmp(kind, g_records[k].kind) != 0) {
        k++;
    }
    if ((k == n_kinds || g_records[k].sized) && !(plan->seen & PLAN_SHAPE)) {
        empanel_util_format_err(err, err_size, "%s:%d: '%s' before 'shape'", r->path, r->line_no, kind);
        return -1;
    }
    if (k == n_kinds) {
        empanel_util_format_err(err, err_size, "%s:%d: unknown record '%s'", r->path, r->line_no, kind);
        return -1;
    }
    enum record_result got = g_records[k].parse(r, plan, err, err_size);
    if (got == RECORD_FIXED && *r->pos != '\0') {
        got = RECORD_BAD; // more fields than the record has
    }
    switch (got) {
        case RECORD_FIXED:
        case RECORD_LINE:
            plan->seen |= g_records[k].seen;
            return 0;
        case RECORD_BAD:
            empanel_util_format_err(err, err_size, "%s:%d: a bad '%s' record", r->path, r->line_no, kind);
            return -1;
        case RECORD_OOM:
            empanel_util_format_err(err, err_size, "%s:%d: out of memory", r->path, r->line_no);
            return -1;
        default:
            return -1;
    }
}

void empanel_plan_free(struct empanel_plan * plan) {
    for (int32_t i = 0; i < plan->n_paths; i++) {
        free(plan->paths[i]);
    }
    free(plan->paths);
    free(plan->file_sizes);
    free(plan->tensors);
    for (int32_t i = 0; i < plan->n_tensors; i++) {
        free(plan->tensor_names[i]);
    }
    free(plan->tensor_names);
    for (int32_t i = 0; i < plan->n_orders; i++) {
        free(plan->orders[i].experts);
        free(plan->orders[i].uses);
    }
    free(plan->orders);
    for (int32_t i = 0; i < plan->n_digests; i++) {
        free(plan->digests[i].name);
        free(plan->digests[i].digests);
    }
    free(plan->digests);
    free(plan->n_slots);
    for (int32_t i = 0; i < EMPANEL_MAX_MEMORY_SOURCES; i++) {
        for (int k = 0; k < PLAN_MEMORY_ROLES; k++) {
            free(plan->memory[i].path[k]);
        }
    }
    memset(plan, 0, sizeof(*plan));
}

// the plan in f (named `source` in messages) for a load of model_path (see empanel_plan_read)
static int plan_parse(FILE * f, const char * source, const char * model_path, struct empanel_plan * plan, char * err,
                      size_t err_size) {
    struct plan_reader r = { .f = f, .path = source };
    int rc = -1;
    int ended = 0;
    int64_t version = 0;

    // the header and the model first: a load of another model (a draft model) takes no plan
    const char * magic = next_line(&r) ? next_field(&r) : NULL;
    if (magic == NULL || strcmp(magic, "empanel-plan") != 0 || field_i64(&r, &version) != 0) {
        empanel_util_format_err(err, err_size, "%s is not an empanel plan", source);
        goto done;
    }
    if (version != EMPANEL_PLAN_VERSION) {
        empanel_util_format_err(err, err_size, "%s: plan version %" PRId64 ", this sidecar reads version %d (the package and "
                "its libraries are from different builds)", source, version, EMPANEL_PLAN_VERSION);
        goto done;
    }
    if (!next_line(&r) || parse_record(&r, plan, err, err_size) != 0 || plan->model[0] == '\0') {
        empanel_util_format_err(err, err_size, "%s:%d: the second record must be 'model'", source, r.line_no);
        goto done;
    }
    char resolved[PATH_MAX];
    if (realpath(model_path, resolved) == NULL || strcmp(resolved, plan->model) != 0) {
        rc = 0; // not the planned model: it loads as usual
        goto done;
    }
    while (!ended && next_line(&r)) {
        int got = parse_record(&r, plan, err, err_size);
        if (got < 0) {
            goto done;
        }
        ended = got == 1;
    }
    int required = PLAN_REQUIRED;
    int paged    = 0;
    for (int32_t il = 0; plan->n_slots != NULL && il < plan->n_layer; il++) {
        paged |= plan->n_slots[il] > 0;
    }
    if (!paged) {
        required &= ~PLAN_TENSOR; // observed layers only (a routing trace): no pool tensor
    }
    if (!ended || (plan->seen & required) != required) {
        empanel_util_format_err(err, err_size, "%s: incomplete plan (no 'end' record, or a required record missing: "
                                "model, file, shape, params, guess, subst, preload, slots, tensor)", source);
        goto done;
    }
    for (int32_t il = 0; il < plan->n_layer; il++) {
        if (plan->n_slots[il] > 0 && plan->n_slots[il] < plan->n_expert_used) {
            empanel_util_format_err(err, err_size, "%s: layer %d has %d slots, fewer than the %d experts a token uses",
                                    source, il, plan->n_slots[il], plan->n_expert_used);
            goto done;
        }
    }
    if (plan->elastic && plan->n_memory == 0) {
        empanel_util_format_err(err, err_size, "%s: 'elastic' without a 'memory' record to watch", source);
        goto done;
    }
    if (plan->pinned && !plan->preload) {
        empanel_util_format_err(err, err_size, "%s: 'pin 1' needs 'preload 1' (pinned pools hold expert e in slot e "
                                "from the load on)", source);
        goto done;
    }
    rc = 1;
done:
    if (rc != 1) {
        empanel_plan_free(plan);
    }
    if (rc < 0 && err != NULL && err_size > 0 && err[0] == '\0') {
        empanel_util_format_err(err, err_size, "%s: could not be read", source);
    }
    free(r.line);
    return rc;
}

int empanel_plan_read(const char * plan_path, const char * model_path, struct empanel_plan * plan, char * err,
                      size_t err_size) {
    memset(plan, 0, sizeof(*plan));
    empanel_util_format_err(err, err_size, "%s", "");
    FILE * f = fopen(plan_path, "r");
    if (f == NULL) {
        empanel_util_format_err(err, err_size, "the plan %s: %s", plan_path, strerror(errno));
        return -1;
    }
    const int rc = plan_parse(f, plan_path, model_path, plan, err, err_size);
    fclose(f);
    return rc;
}

int empanel_plan_read_text(const char * text, const char * model_path, struct empanel_plan * plan, char * err,
                           size_t err_size) {
    memset(plan, 0, sizeof(*plan));
    empanel_util_format_err(err, err_size, "%s", "");
    FILE * f = fmemopen((void *) text, strlen(text), "r");
    if (f == NULL) {
        empanel_util_format_err(err, err_size, "the plan: %s", strerror(errno));
        return -1;
    }
    const int rc = plan_parse(f, "the plan", model_path, plan, err, err_size);
    fclose(f);
    return rc;
}
