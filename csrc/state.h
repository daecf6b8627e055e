#pragma once

// The state of one model's pools (struct empanel_pool), by concern: what is fixed at init
// (config), the first failure (error), the model files (files), the lanes of reads (lanes), the
// reader, the host-RAM tier, the budget, the trace and the failpoints. Each part names the unit that
// changes it; pool.c makes and frees the whole.

#include "io.h"
#include "layer.h"

// a file of the model (one per shard), as it was when the pool was made
struct empanel_file {
    char   * path;
    int      fd;            // buffered reads, fstat
    int      fd_direct;     // O_DIRECT reads, or -1
    uint64_t size;          // bytes
    int64_t  mtime_ns;
    int64_t  ctime_ns;      // inode change time: no user can set it
    int      watch;         // inotify watch descriptor, or -1
};

// the model files of a pool (files.c)
struct empanel_files {
    int32_t n;
    struct empanel_file * list;   // [n]
    int     watch_fd;             // inotify instance watching the files for writes, or -1
    int32_t changed;              // a file seen changed (for good), or -1
    char    changed_why[128];
};

// the host-RAM tier of device pools (host_cache.c): n_entries experts of entry_bytes each
struct empanel_host_cache {
    uint8_t  * raw;          // the allocation (pinned host memory where the device offers it)
    void     * buffer;       // its backend buffer, or NULL (malloc)
    uint8_t  * base;         // raw, aligned to EMPANEL_ALIGN
    uint64_t   entry_bytes;  // one expert: every tiered tensor's O_DIRECT window
    int32_t    n_entries;    // 0: no tier
    int32_t  * layer_of;     // [n_entries] layer of the expert the entry is for, -1: none
    int32_t  * expert_of;    // [n_entries]
    uint8_t  * held;         // [n_entries] bit per tensor of the layer: its bytes are in the entry
    uint64_t * batch;        // [n_entries] the read batch that last used the entry
    int32_t  * prev;         // [n_entries] recency list, least recent first
    int32_t  * next;         // [n_entries]
    int32_t    lru_head;
    int32_t    lru_tail;
    int32_t  * entry_of;     // [n_layer * n_expert] entry of (layer, expert), -1: none
};

// the resident experts of all layers (slots.c) and their live budget (budget.c moves it, the
// controller of pressure.c among others): every resident (layer, slot) in one recency list, least
// recently used first. g-lru evicts from it on every miss; the per-layer policies only when the
// budget is below the pools' capacity (their slots), then the least recent expert of any layer
// goes. Guarded by the pool's lock
struct empanel_budget {
    uint64_t  bytes;            // the budget now: resident expert bytes over all layers
    uint64_t  capacity_bytes;   // every slot of every layer full (the most a budget means)
    uint64_t  floor_bytes;      // the least budget taken (empanel_pool_set_budget refuses less)
    uint64_t  resident_bytes;
    uint64_t  lowest_bytes;     // the lowest budget since the pool was made
    uint64_t  n_changes;        // budget changes (empanel_pool_set_budget)
    uint64_t  given_back_bytes; // bytes of experts emptied while over the budget (their pages returned)
    uint64_t  ceiling_bytes;    // the budget the app set (empanel_pool_set_budget): the controller
                                // grows no higher; 0: none set, the capacity
    uint64_t  max_over_bytes;   // the most resident bytes exceeded the budget (slots make_room kept)
    uint64_t  busy_call;        // the remap call of the layer computing now (remap.c): its slots stay
    const char * fixed_why;     // why this pool's budget cannot move (NULL: it can)
    int32_t   n_entries;     // slots of all layers
    int32_t * prev;          // [n_entries]
    int32_t * next;          // [n_entries]
    int32_t * entry_layer;   // [n_entries]
    int32_t   head;          // least recent, -1 if empty
    int32_t   tail;          // most recent
};

// the controller that moves the budget with the memory left (pressure.c: its thread writes the
// figures under the pool's lock, available_bytes at every poll)
struct empanel_pressure {
    struct empanel_watch * watch;  // the thread and its sources (pressure.c), NULL: not elastic
    uint64_t    reserve_bytes;     // memory kept free
    atomic_ullong available_bytes; // as last read (UINT64_MAX: unknown)
    uint64_t    n_shrinks;
    uint64_t    n_grows;
    atomic_ullong n_events;        // polls that heard the kernel reclaim in vain (pressure.c)
    atomic_ullong n_unread;        // source readings that failed
    int         hears_kernel;      // 1: events registered on a watched cgroup
    double      max_lock_wait_ms;  // a move down's longest wait for the pool's lock
    double      last_shrink_ms;    // from reading low memory to the pages given back
    double      max_shrink_ms;
};

// the routing trace (trace.c, empanel_trace_enable): records [il, n_tokens, n_used, ids].
// Guarded by the pool's lock
struct empanel_trace {
    int       on;
    int32_t * records;       // [cap]
    uint64_t  len;
    uint64_t  cap;
};

// what is fixed once the pool is made (pool.c): read by any thread without the lock
struct empanel_config {
    int32_t   policy;       // enum empanel_policy
    int       verify;       // every expert read is hashed and checked against its digest
    int       lab;          // the policy lab (empanel_lab_init): no files, nothing is read
    int32_t   prefetch;     // paged layers ahead whose guessed misses are read
    int       prompt_ahead; // a prompt's waves read the next layer's empty slots ahead
    float     subst_ratio;  // routing substitution: a stand-in's share of the missing expert's score; 0: off
};

// the pool's first failure (util.c, empanel_util_set_error: any thread, the first failure wins;
// pool.c's empanel_pool_clear_error forgets it)
struct empanel_error {
    atomic_int failed;         // 1: message holds the first failure (set once it is written)
    atomic_int claimed;        // 1: a thread took the first failure and writes message
    char       message[512];
};

// the lanes of reads (batch.c): the batch in flight in each and the staging they share
struct empanel_lanes {
    struct empanel_batch      batch[EMPANEL_N_LANES];
    struct empanel_staging    staging;
    uint64_t                  n_batches;   // batches posted so far: the host tier's batch stamp
};

// one per model (pool.c makes and frees it). `lock` guards every field and every layer, except:
// error (atomics, util.c: any thread, the first failure wins), the reader's posted batch (its own
// mutex, reader.c) and what is fixed after init (n_layer, n_expert, config, the files' descriptors)
struct empanel_pool {
    pthread_mutex_t lock;   // one remap, guess, ready or API call at a time
    int32_t n_layer;
    int32_t n_expert;
    struct empanel_layer * layers; // [n_layer]

    struct empanel_config     config;      // pool.c: fixed after init
    struct empanel_files      files;       // files.c
    struct empanel_reader     reader;      // reader.c
    struct empanel_host_cache host_cache;  // host_cache.c
    struct empanel_lanes      lanes;       // batch.c

    // a read-ahead that found a layer's overlapped reads in flight and may not go beside them
    // (empanel_batch_beside): posted once they are done (empanel_guess_post_deferred), dropped by
    // the next remap (guess.c)
    struct empanel_layer    * deferred_guess;  // its live guess (tables.distinct, guess.n) is read ahead

    char notice[256];

    uint64_t call;          // remap calls so far: the LRU clock

    struct empanel_budget budget;  // slots.c, budget.c
    struct empanel_pressure pressure; // pressure.c
    struct empanel_trace trace;  // trace.c
    struct empanel_error error;  // util.c
    struct empanel_fault fault;  // reader.c
};
