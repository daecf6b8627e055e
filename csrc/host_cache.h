#pragma once

// host_cache.c: the host-RAM tier of device pools (struct empanel_host_cache, state.h):
// moe_host_cache bytes of experts kept in (pinned) host memory, least recently used out, so a
// miss of a device pool is a copy, not a read

#include "io.h"

struct empanel_layer;

// the tier of moe_host_cache bytes for the pools in device memory (after every pool is bound); 0, or
// -1 with the reason in err
int      empanel_host_cache_init(struct empanel_pool * pool, uint64_t bytes, char * err, size_t err_size);
void     empanel_host_cache_free(struct empanel_pool * pool);
// where tensor ti of (layer, expert) sits in the tier, taking an entry for it if it has none
// (the least recently used one, not taken by this read batch); *hit: its bytes are there. NULL:
// no tier for the tensor, or no entry free for this batch
uint8_t * empanel_host_cache_get(struct empanel_pool * pool, struct empanel_layer * layer, int32_t ti,
                                 int32_t expert, uint64_t batch, int * hit);
// the read of tensor ti of (layer, expert) into its entry succeeded (ok) or failed
void     empanel_host_cache_landed(struct empanel_pool * pool, const struct empanel_layer * layer, int32_t ti,
                                   int32_t expert, int ok);
// the reads of a finished batch into tier entries: held there if it succeeded (ok), else not
void     empanel_host_cache_batch_landed(struct empanel_pool * pool, const struct empanel_batch * batch, int ok);
