// The helpers every unit of the sidecar uses: errors (a pool's first failure, a caller's err
// buffer), the monotonic clock and the expert digest. They depend on nothing but the pool's
// struct, so every unit that uses them (batch.c, host_cache.c, load.c, plan_file.c, pool.c,
// preload.c, reader.c, remap.c, rpc.c) shares them without depending on the others.

#include "empanel.h"
#include "empanel-impl.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <sched.h>
#include <stdio.h>
#include <time.h>

// xxHash from llama.cpp's vendor/hash (the pinned source tree), header only
#define XXH_INLINE_ALL
#include "xxhash.h"

void empanel_set_error(struct empanel_pool * pool, const char * fmt, ...) {
    // the first failure is the cause: the thread that claims the message writes it, and `failed`
    // is set only once it is whole, so no reader (of `failed`, then `error`) sees it torn while
    // reader threads fail at the same time
    int unclaimed = 0;
    if (!atomic_compare_exchange_strong(&pool->error_claimed, &unclaimed, 1)) {
        while (!atomic_load(&pool->failed)) {
            sched_yield(); // another thread writes the first failure: it is set on return, as ours would be
        }
        return;
    }
    va_list args;
    va_start(args, fmt);
    vsnprintf(pool->error, sizeof(pool->error), fmt, args);
    va_end(args);
    atomic_store(&pool->failed, 1);
}

void empanel_format_err(char * err, size_t err_size, const char * fmt, ...) {
    if (err == NULL || err_size == 0) {
        return;
    }
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, err_size, fmt, args);
    va_end(args);
}

uint64_t empanel_thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

uint64_t empanel_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

uint64_t empanel_hash64(const void * data, uint64_t n) {
    const uint64_t h = (uint64_t) XXH3_64bits(data, (size_t) n);
    return h + (h == 0); // 0 means "not known"
}
