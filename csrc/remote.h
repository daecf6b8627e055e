#pragma once

// remote.c: pools on RPC hosts: an expert's bytes go by hash first (the host's cache may hold
// them), else with the cache flag so that the host keeps them

#include "io.h"

#include <stdatomic.h>

struct empanel_layer;
struct empanel_pool;

// what an RPC host's cache holds of one tensor's experts (struct empanel_tensor.remote; NULL
// unless its pool is on an RPC host)
struct empanel_remote {
    atomic_int cache;   // its host keeps what it is sent (rpc-server -c): 1 yes or not known yet, 0 no
                        // (it refused a hash it was sent); written under the pool's lock, read by
                        // the reader threads without it (chunk.c)
    uint64_t * hash;    // [n_expert] FNV-1a of each expert's bytes as the host's cache names them,
                        // 0: not known yet
    uint8_t  * sent;    // [n_expert] 1: sent to the host with the cache flag by this process
};

// a tensor's remote state for n_expert experts (cache assumed), or NULL (out of memory)
struct empanel_remote * empanel_remote_init(int32_t n_expert);
void empanel_remote_free(struct empanel_remote * remote);
// staging -> the slots of a batch's landed jobs on RPC hosts: those the reader hashed offered by
// hash together (one round trip per host and 128 of them: the host's cache may hold them from an
// earlier run), then the bytes of the rest; 0, or -1 with the error recorded
int  empanel_remote_write_jobs(struct empanel_pool * pool, struct empanel_layer * layer,
                               const struct empanel_read_job * jobs, int32_t n_jobs);
// the misses of a batch, experts[m] -> slots[m] of tensors [t0, t1) of the layer, that the hosts
// may hold, asked in one round trip per host: written[(i - t0) * n + m] 1 if the host wrote the
// expert's bytes into the slot from its cache (nothing to read), else 0 (not held, or not
// answered: a host whose connection failed turns no tensor's writes by hash off)
void empanel_remote_by_hash(struct empanel_layer * layer, int32_t t0, int32_t t1, const int32_t * experts,
                            const int32_t * slots, int32_t n, uint8_t * written);
