// The routing trace: every remap call's expert ids (and every guess's), appended for the lab
// (empanel_trace_enable, empanel_gguf/lab/trace.py reads them).

#include "trace.h"
#include "util.h"
#include "state.h"

#include <stdlib.h>
#include <string.h>

int empanel_trace_call(struct empanel_pool * pool, int32_t il, const int32_t * expert_ids,
                       int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    const uint64_t need = pool->trace.len + 3 + (uint64_t) n_tokens * n_used;
    if (need > pool->trace.cap) {
        uint64_t cap = pool->trace.cap ? pool->trace.cap : 1 << 16;
        while (cap < need) {
            cap *= 2;
        }
        int32_t * grown = realloc(pool->trace.records, sizeof(int32_t) * cap);
        if (grown == NULL) {
            empanel_util_set_error(pool, "trace: out of memory for %llu entries", (unsigned long long) cap);
            return -1;
        }
        pool->trace.records     = grown;
        pool->trace.cap = cap;
    }
    int32_t * out = pool->trace.records + pool->trace.len;
    *out++ = il;
    *out++ = n_tokens;
    *out++ = n_used;
    for (int32_t t = 0; t < n_tokens; t++) {
        memcpy(out, expert_ids + (int64_t) t * ids_row_stride, sizeof(int32_t) * n_used);
        out += n_used;
    }
    pool->trace.len = need;
    return 0;
}

void empanel_trace_enable(struct empanel_pool * pool, int32_t on) {
    pthread_mutex_lock(&pool->lock);
    pool->trace.on = on != 0;
    pthread_mutex_unlock(&pool->lock);
}

uint64_t empanel_trace_size(struct empanel_pool * pool) {
    pthread_mutex_lock(&pool->lock);
    const uint64_t n = pool->trace.len;
    pthread_mutex_unlock(&pool->lock);
    return n;
}

uint64_t empanel_trace_take(struct empanel_pool * pool, int32_t * out, uint64_t max) {
    pthread_mutex_lock(&pool->lock);
    const uint64_t n = pool->trace.len < max ? pool->trace.len : max;
    if (n > 0) {
        memcpy(out, pool->trace.records, sizeof(int32_t) * n);
        memmove(pool->trace.records, pool->trace.records + n, sizeof(int32_t) * (pool->trace.len - n));
        pool->trace.len -= n;
    }
    pthread_mutex_unlock(&pool->lock);
    return n;
}
