#pragma once

// plan_file.c: the plan file (what empanel-gguf decided before a load, written down) read into
// struct empanel_plan; the records are described in plan_file.c

#include "common.h"

// a plan written down (empanel_gguf/planning/plan_file.py; records described in plan_file.c)
struct empanel_plan_order {
    int32_t    layer;
    int32_t    n;
    int32_t  * experts;  // [n]
    uint32_t * uses;     // [n] or NULL
};

struct empanel_plan_digests {
    char     * name;
    int32_t    n;
    uint64_t * digests;  // [n]
};

// one source of the memory left, as the controller reads it (pressure.c): the files of a memory
// cgroup, or a meminfo-style file (struct empanel_memory_source)
enum empanel_plan_memory_role {
    PLAN_MEMORY_LIMIT, PLAN_MEMORY_HIGH, PLAN_MEMORY_USAGE, PLAN_MEMORY_STAT, PLAN_MEMORY_EVENTS, PLAN_MEMORY_AVAILABLE,
    PLAN_MEMORY_ROLES
};
struct empanel_plan_memory {
    char * path[PLAN_MEMORY_ROLES];  // strdup'd, NULL: not read
    char   stat_key[64];
    char   available_key[64];
};

struct empanel_plan {
    char     model[PATH_MAX];       // real path of the first shard
    char     stats_path[PATH_MAX];  // where each load's counters go ("": nowhere)
    int32_t  n_layer;
    int32_t  n_expert;
    int32_t  n_expert_used;
    int32_t  guess_depth;
    int32_t  subst_alt;
    int      preload;
    int      pinned;    // pools that hold every expert run stock's graph (llama_empanel_set_pinned)
    uint64_t host_cache_bytes; // the host-RAM tier of device pools (host_cache.c), 0: none
    int32_t * n_slots;                          // [n_layer]
    char   ** paths;                            // [n_paths] the shards
    uint64_t * file_sizes;                      // [n_paths] their sizes (bytes), as the plan and the files say
    int32_t   n_paths;
    struct empanel_tensor_desc * tensors;       // [n_tensors], names in tensor_names
    char   ** tensor_names;                     // [n_tensors]
    int32_t   n_tensors;
    struct empanel_plan_order   * orders;       // [n_orders]
    int32_t                       n_orders;
    struct empanel_plan_digests * digests;      // [n_digests]
    int32_t                       n_digests;
    struct empanel_pool_params    params;
    int       elastic;                          // the controller moves the budget (pressure.c)
    uint64_t  reserve_bytes;                    // the memory it keeps free
    int32_t   interval_ms;                      // how often it reads the memory left
    struct empanel_plan_memory    memory[EMPANEL_MAX_MEMORY_SOURCES];
    int32_t                       n_memory;     // sources named
    int       seen;                             // records read (plan_file.c's enum plan_record)
};

// the plan at plan_path (a file) or in text (a NUL-terminated string) for a load of model_path: 1
// read into plan; 0 it is another model's (plan empty, err ""); -1 it cannot be used (err says
// why). Free a read plan with empanel_plan_free.
int  empanel_plan_read     (const char * plan_path, const char * model_path, struct empanel_plan * plan, char * err,
                            size_t err_size);
int  empanel_plan_read_text(const char * text, const char * model_path, struct empanel_plan * plan, char * err,
                            size_t err_size);
void empanel_plan_free(struct empanel_plan * plan);
