#pragma once

// internal structures of the sidecar, shared by pool.c (tables, policy) and reader.c (files, reads)

#include "empanel.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#define EMPANEL_MAX_TENSORS 4  // gate, up, down, gate_up

// one routed-expert tensor of a layer: its experts in the file and its pool in memory
struct empanel_tensor {
    char     name[96];
    int32_t  file;          // index into pool->files
    uint64_t offset;        // bytes: expert 0 in the file
    uint64_t expert_size;   // bytes of one expert, in the file and in a slot
    void   * pool;          // ggml_tensor * [ne0, ne1, n_slots], set by empanel_pool_bind
};

struct empanel_layer {
    int32_t  n_slots;       // 0: not paged
    int32_t  n_tensors;
    struct empanel_tensor tensors[EMPANEL_MAX_TENSORS];

    int32_t  * slot_of;     // [n_expert] slot holding the expert, or -1
    int32_t  * expert_in;   // [n_slots]  expert held by the slot, or -1
    uint64_t * last_use;    // [n_slots]  remap call that last used the slot (LRU)
    uint64_t * call_mark;   // [n_slots]  remap call that uses the slot now (never evicted in it)
    uint64_t * miss_mark;   // [n_expert] remap call that listed the expert as a miss
    int32_t  * misses;      // [n_expert] scratch: the current call's misses

    struct empanel_layer_stats stats;
};

// a file of the model (one per shard), as it was when the pool was made
struct empanel_file {
    char   * path;
    int      fd;
    uint64_t size;          // bytes
    int64_t  mtime_ns;
    uint64_t inode;
};

struct empanel_pool {
    pthread_mutex_t lock;   // one remap at a time
    int32_t n_layer;
    int32_t n_expert;
    struct empanel_layer * layers; // [n_layer]

    int32_t n_files;
    struct empanel_file * files;   // [n_files]

    uint8_t * bounce;       // an expert's bytes on their way to a pool that is not plain host memory
    uint64_t  bounce_size;

    uint64_t call;          // remap calls so far: the LRU clock

    atomic_int failed;
    char       error[512];
};

// pool.c
void empanel_set_error(struct empanel_pool * pool, const char * fmt, ...);

// reader.c
int      empanel_files_open (struct empanel_pool * pool, const char * const * paths, int32_t n_paths, char * err, size_t err_size);
void     empanel_files_close(struct empanel_pool * pool);
int      empanel_files_check(struct empanel_pool * pool);
int      empanel_read_expert(struct empanel_pool * pool, const struct empanel_layer * layer, int32_t expert, int32_t slot);
uint64_t empanel_now_ns(void);
