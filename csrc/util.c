// The helpers every unit of the sidecar uses: errors (a pool's first failure, a caller's err
// buffer), the monotonic clock, the expert digest and a sort order. They depend on nothing but
// the pool's struct (state.h), so every unit shares them without depending on the others.

#include "util.h"
#include "state.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <sched.h>
#include <stdio.h>
#include <time.h>

// xxHash from llama.cpp's vendor/hash (the pinned source tree), header only
#define XXH_INLINE_ALL
#include "xxhash.h"

void empanel_util_set_error(struct empanel_pool * pool, const char * fmt, ...) {
    // the first failure is the cause: the thread that claims the message writes it, and `failed`
    // is set only once it is whole, so no reader (of `failed`, then `error`) sees it torn while
    // reader threads fail at the same time
    int unclaimed = 0;
    if (!atomic_compare_exchange_strong(&pool->error.claimed, &unclaimed, 1)) {
        while (!atomic_load(&pool->error.failed)) {
            sched_yield(); // another thread writes the first failure: it is set on return, as ours would be
        }
        return;
    }
    va_list args;
    va_start(args, fmt);
    vsnprintf(pool->error.message, sizeof(pool->error.message), fmt, args);
    va_end(args);
    atomic_store(&pool->error.failed, 1);
}

void empanel_util_format_err(char * err, size_t err_size, const char * fmt, ...) {
    if (err == NULL || err_size == 0) {
        return;
    }
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, err_size, fmt, args);
    va_end(args);
}

uint64_t empanel_util_thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

uint64_t empanel_util_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

uint64_t empanel_hash64(const void * data, uint64_t n) {
    const uint64_t h = (uint64_t) XXH3_64bits(data, (size_t) n);
    return h + (h == 0); // 0 means "not known"
}

int empanel_util_compare_uint64(const void * a, const void * b) {
    const uint64_t x = *(const uint64_t *) a;
    const uint64_t y = *(const uint64_t *) b;
    return (x > y) - (x < y);
}
