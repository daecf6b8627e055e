// The controller: one thread per elastic pool, started by empanel_pool_watch_memory, reads the
// memory the binding limits leave every interval and moves the live budget (budget.c):
//
//   left < reserve                    down at once: budget = resident - (reserve - left) - reserve / 2
//   left > 1.75 reserves + promised   up, 2 s after the last move down and 0.5 s after the last move
//                                     up: to leave 1.5 reserves free once the budget is filled
//                                     (promised: budget not yet filled, which reads will take)
//
// so moves down and up both leave 1.5 reserves free, and the budget does not swing: the next move
// down needs another half of the reserve taken by someone else, the next move up a quarter of it
// freed. (With up to 1.125 reserves, page cache and buffers coming and going moved the 12-layer
// bench model's budget 4-5 times down and 9-11 up in a 64-token decode, each move down evicting
// experts read moments before.) Which files tell
// the memory left is decided by the planner (empanel_gguf/planning/host_memory.py, the one
// definition); here they are read as told: a cgroup's limit - usage + reclaimable page cache, or
// a meminfo-style key. Each file stays open and is read again from offset 0 at every poll (a few
// microseconds; cgroup and proc files regenerate on each read).

#include "pressure.h"
#include "budget.h"
#include "state.h"
#include "util.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PRESSURE_GROW_AFTER_SHRINK_NS 2000000000ull // no move up within 2 s of a move down
#define PRESSURE_GROW_EVERY_NS         500000000ull // moves up at most every 0.5 s
#define PRESSURE_NO_LIMIT             (1ull << 60)  // cgroup v1 writes 2^63 - 4096 for none

// several elastic pools in one process (two models) read the same memory: after one moves its
// budget, the others wait for a fresh reading (two polls) instead of cutting for the same deficit
static atomic_ullong g_last_move_ns = 0;

struct watched_source {
    int  limit_fd, usage_fd, stat_fd, available_fd;  // -1: not read
    char stat_key[64];
    char available_key[64];
};

struct empanel_watch {
    struct empanel_pool  * pool;
    pthread_t              thread;
    pthread_mutex_t        lock;       // guards stop (the thread waits on wake between polls)
    pthread_cond_t         wake;
    int                    stop;
    int64_t                interval_ns;
    int32_t                n_sources;
    struct watched_source  sources[EMPANEL_MAX_MEMORY_SOURCES];
};

// ------------------------------------------------------------------------------------------------
// reading the files

// the whole file at fd (from offset 0) into buf, NUL-terminated; its length, or -1
static ssize_t read_whole(int fd, char * buf, size_t size) {
    size_t n = 0;
    while (n + 1 < size) {
        const ssize_t got = pread(fd, buf + n, size - 1 - n, (off_t) n);
        if (got < 0) {
            return -1;
        }
        if (got == 0) {
            break;
        }
        n += (size_t) got;
    }
    buf[n] = '\0';
    return (ssize_t) n;
}

// an integer file ("max": no limit, UINT64_MAX); 0, or -1 if unreadable
static int read_number(int fd, uint64_t * out) {
    char buf[64];
    if (read_whole(fd, buf, sizeof(buf)) <= 0) {
        return -1;
    }
    if (strncmp(buf, "max", 3) == 0) {
        *out = UINT64_MAX;
        return 0;
    }
    char * end = NULL;
    *out = strtoull(buf, &end, 10);
    return end == buf ? -1 : 0;
}

// the value of `key` in a file of lines "key value" or "key: value kB" (kB: times 1024); 0, or -1
static int read_keyed(int fd, const char * key, uint64_t * out) {
    char buf[16384];
    if (read_whole(fd, buf, sizeof(buf)) <= 0) {
        return -1;
    }
    const size_t klen = strlen(key);
    for (const char * line = buf; line != NULL && *line != '\0'; ) {
        const char * next = strchr(line, '\n');
        if (strncmp(line, key, klen) == 0 && (line[klen] == ' ' || line[klen] == ':' || line[klen] == '\t')) {
            const char * p = line + klen + (line[klen] == ':');
            char * end = NULL;
            const uint64_t v = strtoull(p, &end, 10);
            if (end == p) {
                return -1;
            }
            while (*end == ' ' || *end == '\t') {
                end++;
            }
            *out = strncmp(end, "kB", 2) == 0 ? v * 1024u : v;
            return 0;
        }
        line = next != NULL ? next + 1 : NULL;
    }
    return -1;
}

// what one source leaves (UINT64_MAX: no limit, or unreadable)
static uint64_t source_left(const struct watched_source * s) {
    uint64_t v = 0;
    if (s->available_fd >= 0) {
        return read_keyed(s->available_fd, s->available_key, &v) == 0 ? v : UINT64_MAX;
    }
    uint64_t limit = 0, usage = 0, reclaimable = 0;
    if (s->limit_fd < 0 || s->usage_fd < 0 || read_number(s->limit_fd, &limit) != 0 || limit >= PRESSURE_NO_LIMIT ||
        read_number(s->usage_fd, &usage) != 0) {
        return UINT64_MAX;
    }
    if (s->stat_fd >= 0 && read_keyed(s->stat_fd, s->stat_key, &reclaimable) != 0) {
        reclaimable = 0;
    }
    const uint64_t used = usage > reclaimable ? usage - reclaimable : 0;
    return limit > used ? limit - used : 0;
}

static uint64_t sources_left(const struct watched_source * sources, int32_t n) {
    uint64_t least = UINT64_MAX;
    for (int32_t i = 0; i < n; i++) {
        const uint64_t v = source_left(&sources[i]);
        least = v < least ? v : least;
    }
    return least;
}

static int open_if(const char * path) {
    return path != NULL && path[0] != '\0' ? open(path, O_RDONLY | O_CLOEXEC) : -1;
}

static void close_sources(struct watched_source * sources, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        const int fds[4] = { sources[i].limit_fd, sources[i].usage_fd, sources[i].stat_fd, sources[i].available_fd };
        for (int j = 0; j < 4; j++) {
            if (fds[j] >= 0) {
                close(fds[j]);
            }
        }
    }
}

// the sources opened into out [n]; 0, or -1 with why in err (a named file that cannot be opened)
static int open_sources(const struct empanel_memory_source * in, int32_t n, struct watched_source * out,
                        char * err, size_t err_size) {
    for (int32_t i = 0; i < n; i++) {
        struct watched_source * s = &out[i];
        s->limit_fd     = open_if(in[i].limit_path);
        s->usage_fd     = open_if(in[i].usage_path);
        s->stat_fd      = open_if(in[i].stat_path);
        s->available_fd = open_if(in[i].available_path);
        snprintf(s->stat_key, sizeof(s->stat_key), "%s", in[i].stat_key != NULL ? in[i].stat_key : "");
        snprintf(s->available_key, sizeof(s->available_key), "%s", in[i].available_key != NULL ? in[i].available_key : "");
        const int want_cgroup = in[i].limit_path != NULL && in[i].limit_path[0] != '\0';
        const int ok = want_cgroup ? s->limit_fd >= 0 && s->usage_fd >= 0 : s->available_fd >= 0;
        if (!ok) {
            empanel_util_format_err(err, err_size, "memory source %d: cannot open %s", i,
                                    want_cgroup ? (s->limit_fd < 0 ? in[i].limit_path : in[i].usage_path)
                                                : (in[i].available_path != NULL ? in[i].available_path : "(no file named)"));
            close_sources(out, i + 1);
            return -1;
        }
    }
    return 0;
}

uint64_t empanel_memory_available(const struct empanel_memory_source * sources, int32_t n_sources) {
    struct watched_source opened[EMPANEL_MAX_MEMORY_SOURCES];
    char err[256];
    if (n_sources <= 0 || n_sources > EMPANEL_MAX_MEMORY_SOURCES ||
        open_sources(sources, n_sources, opened, err, sizeof(err)) != 0) {
        return UINT64_MAX;
    }
    const uint64_t left = sources_left(opened, n_sources);
    close_sources(opened, n_sources);
    return left;
}

// ------------------------------------------------------------------------------------------------
// the thread

// one poll: the budget moved as the memory left says
static void poll_once(struct empanel_watch * w, uint64_t * last_shrink_ns, uint64_t * last_grow_ns) {
    struct empanel_pool * pool = w->pool;
    const uint64_t now  = empanel_util_now_ns();
    const uint64_t left = sources_left(w->sources, w->n_sources);
    atomic_store(&pool->pressure.available_bytes, left);
    if (left == UINT64_MAX) {
        return;
    }
    const uint64_t reserve = pool->pressure.reserve_bytes;
    if (left >= reserve && left <= reserve + 3 * reserve / 4) {
        return; // the band where nothing moves: no lock taken
    }
    const uint64_t moved = atomic_load(&g_last_move_ns);
    if (moved != 0 && now - moved < 2 * (uint64_t) w->interval_ns && moved != *last_shrink_ns && moved != *last_grow_ns) {
        return; // another pool of this process just moved: its pages are not in this reading yet
    }
    if (left >= reserve) {
        if (pthread_mutex_trylock(&pool->lock) != 0) {
            return; // a remap runs: a move up waits for the next poll, never the decode for it
        }
    } else {
        pthread_mutex_lock(&pool->lock);
    }
    const uint64_t budget   = pool->budget.bytes;
    const uint64_t resident = pool->budget.resident_bytes;
    const uint64_t promised = budget > resident ? budget - resident : 0;
    if (left < reserve) {
        const uint64_t cut    = reserve - left + reserve / 2;
        const uint64_t target = resident > cut ? resident - cut : 0;
        if (target < budget && budget > pool->budget.floor_bytes) {
            empanel_budget_set_locked(pool, target);
            const double ms = (double) (empanel_util_now_ns() - now) / 1e6;
            pool->pressure.n_shrinks++;
            pool->pressure.last_shrink_ms = ms;
            pool->pressure.max_shrink_ms  = ms > pool->pressure.max_shrink_ms ? ms : pool->pressure.max_shrink_ms;
            *last_shrink_ns = now;
            atomic_store(&g_last_move_ns, now);
        }
    } else if (left > promised + reserve + 3 * reserve / 4 && budget < pool->budget.capacity_bytes &&
               now - *last_shrink_ns >= PRESSURE_GROW_AFTER_SHRINK_NS && now - *last_grow_ns >= PRESSURE_GROW_EVERY_NS) {
        empanel_budget_set_locked(pool, budget + (left - promised - reserve - reserve / 2));
        pool->pressure.n_grows++;
        *last_grow_ns = now;
        atomic_store(&g_last_move_ns, now);
    }
    pthread_mutex_unlock(&pool->lock);
}

static void * watch_main(void * arg) {
    struct empanel_watch * w = arg;
    uint64_t last_shrink_ns = 0, last_grow_ns = 0;
    pthread_mutex_lock(&w->lock);
    while (!w->stop) {
        pthread_mutex_unlock(&w->lock);
        poll_once(w, &last_shrink_ns, &last_grow_ns);
        pthread_mutex_lock(&w->lock);
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        const int64_t ns = until.tv_nsec + w->interval_ns;
        until.tv_sec  += ns / 1000000000;
        until.tv_nsec  = ns % 1000000000;
        while (!w->stop && pthread_cond_timedwait(&w->wake, &w->lock, &until) == 0) {
        }
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

// the pools' host memory out of transparent huge pages: where THP is "always", khugepaged would
// collapse a range the budget gave back into a huge page again (max_ptes_none lets it fill up to
// 511 of 512 small pages), taking the memory back behind the controller's back. (Where THP is
// "madvise", the default of most distributions, nothing changes: ggml never asks for huge pages.)
static void pools_without_huge_pages(struct empanel_pool * pool) {
#if defined(__linux__) && defined(MADV_NOHUGEPAGE)
    const uint64_t page = (uint64_t) sysconf(_SC_PAGESIZE);
    for (int32_t il = 0; il < pool->n_layer; il++) {
        const struct empanel_layer * layer = &pool->layers[il];
        for (int32_t i = 0; i < layer->n_tensors; i++) {
            const struct empanel_tensor * t = &layer->tensors[i];
            if (t->host != NULL) {
                const uint64_t begin = (uint64_t) (uintptr_t) t->host / page * page;
                const uint64_t end   = (uint64_t) (uintptr_t) t->host + (uint64_t) layer->n_slots * t->expert_size;
                madvise((void *) (uintptr_t) begin, end - begin, MADV_NOHUGEPAGE);
            }
        }
    }
#else
    (void) pool;
#endif
}

int32_t empanel_pool_watch_memory(struct empanel_pool * pool, const struct empanel_memory_source * sources,
                                  int32_t n_sources, uint64_t reserve_bytes, int32_t interval_ms,
                                  char * err, size_t err_size) {
    if (empanel_budget_movable(pool, err, err_size) != 0) {
        return -1;
    }
    if (pool->pressure.watch != NULL) {
        empanel_util_format_err(err, err_size, "the memory is watched already");
        return -1;
    }
    if (n_sources <= 0 || n_sources > EMPANEL_MAX_MEMORY_SOURCES || interval_ms <= 0) {
        empanel_util_format_err(err, err_size, "watching memory: %d sources (1 to %d), every %d ms", n_sources,
                                EMPANEL_MAX_MEMORY_SOURCES, interval_ms);
        return -1;
    }
    struct empanel_watch * w = calloc(1, sizeof(*w));
    if (w == NULL) {
        empanel_util_format_err(err, err_size, "watching memory: out of memory");
        return -1;
    }
    w->pool        = pool;
    w->interval_ns = (int64_t) interval_ms * 1000000;
    w->n_sources   = n_sources;
    if (open_sources(sources, n_sources, w->sources, err, err_size) != 0) {
        free(w);
        return -1;
    }
    pthread_mutex_init(&w->lock, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&w->wake, &attr);
    pthread_condattr_destroy(&attr);
    pool->pressure.reserve_bytes = reserve_bytes;
    pools_without_huge_pages(pool);
    if (pthread_create(&w->thread, NULL, watch_main, w) != 0) {
        empanel_util_format_err(err, err_size, "watching memory: no thread");
        close_sources(w->sources, n_sources);
        pthread_cond_destroy(&w->wake);
        pthread_mutex_destroy(&w->lock);
        free(w);
        return -1;
    }
    pthread_mutex_lock(&pool->lock);
    pool->pressure.watch = w;
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

void empanel_pressure_stop(struct empanel_pool * pool) {
    struct empanel_watch * w = pool->pressure.watch;
    if (w == NULL) {
        return;
    }
    pthread_mutex_lock(&w->lock);
    w->stop = 1;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    close_sources(w->sources, w->n_sources);
    pthread_cond_destroy(&w->wake);
    pthread_mutex_destroy(&w->lock);
    free(w);
    pool->pressure.watch = NULL;
}
