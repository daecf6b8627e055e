// The controller: one thread per elastic pool, started by empanel_pool_watch_memory, reads the
// memory the binding limits leave every interval and moves the live budget (budget.c):
//
//   left < reserve                    down at once: budget = resident - (reserve - left) - reserve / 2
//   the kernel reclaims in vain       down at once by a step: the reserve, 1.5 times the last step
//   where the files show room         at each further event within 1 s (cgroup v1
//                                     memory.pressure_level, "critical": the group's reclaim finds
//                                     little to take; steps that double overshoot to the floor,
//                                     docs/performance.md)
//   left > 1.75 reserves + promised   up, 2 s after the last move down and 0.5 s after the last move
//                                     up, to leave 1.5 reserves free once the budget is filled
//                                     (promised: budget not yet filled, which reads will take), never
//                                     above a budget the app set (empanel_pool_set_budget)
//
// A move down gives back at most PRESSURE_MAX_STEP_BYTES, so that none holds the pools' lock
// for long; a larger cut goes on at the next poll, which comes at once.
// So moves down and up both leave 1.5 reserves free and the budget does not swing: the next move
// down needs another half of the reserve taken by someone else, the next move up a quarter of it
// freed (narrower bands swing: docs/reliability.md). The events are how a limit lowered
// under what the group holds gets through: cgroup v1 refuses such a write (EBUSY) after one
// reclaim pass and leaves the limit file as it was, so no reading of the files sees it, but the
// pass is heard; the writer's next try succeeds once the pools gave back. Which files tell the
// memory left is decided by the planner (empanel_gguf/planning/host_memory.py, the one
// definition); here they are read as told: a cgroup's lower limit (max, high) - usage + reclaimable
// page cache, or a meminfo-style key. Each file stays open and is read again from offset 0 at
// every poll (a few microseconds; cgroup and proc files regenerate on each read). A source whose
// files cannot be opened or read is skipped, said once on stderr and counted (n_unread).

#include "pressure.h"
#include "budget.h"
#include "state.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PRESSURE_GROW_AFTER_SHRINK_NS 2000000000ull // no move up within 2 s of a move down
#define PRESSURE_GROW_EVERY_NS         500000000ull // moves up at most every 0.5 s
#define PRESSURE_EVENT_STREAK_NS      1000000000ull // events within 1 s of the last cut double the step
#define PRESSURE_MAX_STEP_BYTES       (768ull << 20) // one move down gives back at most this (the kernel
                                                    // frees ~14 GiB/s here: ~55 ms); the rest, at once after

// several elastic pools in one process (two models) read the same memory: after one moves its
// budget, the others wait for a fresh reading (two polls) instead of cutting for the same deficit
static atomic_ullong g_last_move_ns = 0;

struct watched_source {
    int  limit_fd, high_fd, usage_fd, stat_fd, available_fd;  // -1: not read
    int  event_fd;    // an eventfd the kernel signals at critical reclaim in the cgroup; -1: none
    int  level_fd;    // the memory.pressure_level it is registered on (open while registered)
    int  unread;      // 1 while a file of it cannot be read (said once)
    char stat_key[64];
    char available_key[64];
    char name[256];   // the limit or available file, for notices
};

struct empanel_watch {
    struct empanel_pool  * pool;
    pthread_t              thread;
    int                    stop_fd;    // an eventfd: written once to stop the thread
    int64_t                interval_ns;
    int32_t                n_sources;
    uint64_t               last_shrink_ns, last_grow_ns;
    uint64_t               last_event_ns, event_step;  // the last cut for kernel events, its size
    int                    owing;      // the last poll's move down stopped at PRESSURE_MAX_STEP_BYTES: poll at once
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

// what one source leaves into *left (UINT64_MAX: no limit now); 0, or -1 if a file of it cannot be
// read (or was never opened)
static int source_left(const struct watched_source * s, uint64_t * left) {
    uint64_t v = 0;
    *left = UINT64_MAX;
    if (s->available_fd >= 0) {
        if (read_keyed(s->available_fd, s->available_key, &v) != 0) {
            return -1;
        }
        *left = v;
        return 0;
    }
    uint64_t limit = 0, high = UINT64_MAX, usage = 0, reclaimable = 0;
    if (s->limit_fd < 0 || s->usage_fd < 0 || read_number(s->limit_fd, &limit) != 0 ||
        (s->high_fd >= 0 && read_number(s->high_fd, &high) != 0) || read_number(s->usage_fd, &usage) != 0) {
        return -1;
    }
    limit = high < limit ? high : limit;
    if (limit >= EMPANEL_MEMORY_NO_LIMIT) {
        return 0;
    }
    if (s->stat_fd >= 0 && read_keyed(s->stat_fd, s->stat_key, &reclaimable) != 0) {
        reclaimable = 0;
    }
    const uint64_t used = usage > reclaimable ? usage - reclaimable : 0;
    *left = limit > used ? limit - used : 0;
    return 0;
}

// the least the sources leave (UINT64_MAX: no limit, or none readable); sources that cannot be read
// are counted in *n_unread and said once each
static uint64_t sources_left(struct watched_source * sources, int32_t n, uint64_t * n_unread) {
    uint64_t least = UINT64_MAX;
    for (int32_t i = 0; i < n; i++) {
        uint64_t v = UINT64_MAX;
        const int bad = source_left(&sources[i], &v) != 0;
        if (bad && !sources[i].unread) {
            fprintf(stderr, "empanel: moe_elastic: cannot read %s (memory source %d): the controller goes on with "
                    "the others\n", sources[i].name, i);
        }
        sources[i].unread = bad;
        *n_unread += (uint64_t) bad;
        least = v < least ? v : least;
    }
    return least;
}

static int open_if(const char * path) {
    return path != NULL && path[0] != '\0' ? open(path, O_RDONLY | O_CLOEXEC) : -1;
}

static void close_if(int fd) {
    if (fd >= 0) {
        close(fd);
    }
}

static void close_source(struct watched_source * s) {
    const int fds[7] = { s->limit_fd, s->high_fd, s->usage_fd, s->stat_fd, s->available_fd, s->event_fd, s->level_fd };
    for (int j = 0; j < 7; j++) {
        close_if(fds[j]);
    }
}

static void close_sources(struct watched_source * sources, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        close_source(&sources[i]);
    }
}

// cgroup v1: an eventfd the kernel signals when reclaim in the group of `level_path`
// (memory.pressure_level) is critical, registered through the cgroup.event_control beside it.
// Nothing where that cannot be done (not permitted: a read-only cgroup mount): the controller then
// hears the group only through its files
static void listen_to_kernel(struct watched_source * s, const char * level_path) {
    s->event_fd = s->level_fd = -1;
    const char * slash = level_path != NULL ? strrchr(level_path, '/') : NULL;
    if (slash == NULL || (size_t) (slash - level_path) + sizeof("/cgroup.event_control") > 4096) {
        return;
    }
    char control_path[4096];
    snprintf(control_path, sizeof(control_path), "%.*s/cgroup.event_control", (int) (slash - level_path), level_path);
    s->level_fd = open(level_path, O_RDONLY | O_CLOEXEC);
    s->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    const int control = open(control_path, O_WRONLY | O_CLOEXEC);
    char line[64];
    const int len = snprintf(line, sizeof(line), "%d %d critical", s->event_fd, s->level_fd);
    const int ok = s->level_fd >= 0 && s->event_fd >= 0 && control >= 0 && write(control, line, (size_t) len) == len;
    close_if(control);
    if (!ok) {
        close_if(s->event_fd);
        close_if(s->level_fd);
        s->event_fd = s->level_fd = -1;
    }
}

// the sources opened into out [*n_open]: a source whose files cannot be opened is left out, said
// on stderr; 0, or -1 with why in err where none could be opened
static int open_sources(const struct empanel_memory_source * in, int32_t n, struct watched_source * out,
                        int32_t * n_open, int events, char * err, size_t err_size) {
    *n_open = 0;
    for (int32_t i = 0; i < n; i++) {
        struct watched_source * s = &out[*n_open];
        memset(s, 0, sizeof(*s));
        s->limit_fd     = open_if(in[i].limit_path);
        s->high_fd      = open_if(in[i].high_path);
        s->usage_fd     = open_if(in[i].usage_path);
        s->stat_fd      = open_if(in[i].stat_path);
        s->available_fd = open_if(in[i].available_path);
        s->event_fd     = s->level_fd = -1;
        snprintf(s->stat_key, sizeof(s->stat_key), "%s", in[i].stat_key != NULL ? in[i].stat_key : "");
        snprintf(s->available_key, sizeof(s->available_key), "%s", in[i].available_key != NULL ? in[i].available_key : "");
        const int want_cgroup = in[i].limit_path != NULL && in[i].limit_path[0] != '\0';
        const char * named = want_cgroup ? in[i].limit_path : in[i].available_path != NULL ? in[i].available_path : "(no file named)";
        snprintf(s->name, sizeof(s->name), "%s", named);
        const int ok = want_cgroup ? s->limit_fd >= 0 && s->usage_fd >= 0 &&
                                     (in[i].high_path == NULL || in[i].high_path[0] == '\0' || s->high_fd >= 0)
                                   : s->available_fd >= 0;
        if (!ok) {
            const char * missing = !want_cgroup ? named : s->limit_fd < 0 ? in[i].limit_path
                                 : s->usage_fd < 0 ? in[i].usage_path : in[i].high_path;
            if (events) {
                fprintf(stderr, "empanel: moe_elastic: cannot open %s (memory source %d): the controller watches the "
                        "others\n", missing, i);
            }
            empanel_util_format_err(err, err_size, "memory source %d: cannot open %s", i, missing);
            close_source(s);
            continue;
        }
        if (events && in[i].events_path != NULL && in[i].events_path[0] != '\0') {
            listen_to_kernel(s, in[i].events_path);
        }
        (*n_open)++;
    }
    return *n_open > 0 ? 0 : -1;
}

uint64_t empanel_memory_available(const struct empanel_memory_source * sources, int32_t n_sources) {
    struct watched_source opened[EMPANEL_MAX_MEMORY_SOURCES];
    char err[256];
    int32_t n_open = 0;
    if (n_sources <= 0 || n_sources > EMPANEL_MAX_MEMORY_SOURCES ||
        open_sources(sources, n_sources, opened, &n_open, 0, err, sizeof(err)) != 0) {
        return UINT64_MAX;
    }
    uint64_t n_unread = 0;
    const uint64_t left = n_open == n_sources ? sources_left(opened, n_open, &n_unread) : UINT64_MAX;
    close_sources(opened, n_open);
    return n_unread == 0 ? left : UINT64_MAX;
}

// ------------------------------------------------------------------------------------------------
// the thread

// whether the kernel signalled critical reclaim in a watched cgroup since the last poll (the
// counters drained)
static int kernel_reclaims(struct watched_source * sources, int32_t n) {
    int heard = 0;
    for (int32_t i = 0; i < n; i++) {
        uint64_t count = 0;
        if (sources[i].event_fd >= 0 && read(sources[i].event_fd, &count, sizeof(count)) == (ssize_t) sizeof(count)) {
            heard |= count > 0;
        }
    }
    return heard;
}

// the budget down to target (with the lock held), counted as a shrink that took from `since`
static void shrink_locked(struct empanel_watch * w, uint64_t target, uint64_t since) {
    struct empanel_pool * pool = w->pool;
    empanel_budget_set_locked(pool, target);
    const uint64_t now = empanel_util_now_ns();
    const double   ms  = (double) (now - since) / 1e6;
    pool->pressure.n_shrinks++;
    pool->pressure.last_shrink_ms = ms;
    pool->pressure.max_shrink_ms  = ms > pool->pressure.max_shrink_ms ? ms : pool->pressure.max_shrink_ms;
    w->last_shrink_ns = since;
    atomic_store(&g_last_move_ns, since);
}

// one poll: the budget moved as the memory left and the kernel's events say
static void poll_once(struct empanel_watch * w) {
    struct empanel_pool * pool = w->pool;
    const uint64_t now      = empanel_util_now_ns();
    uint64_t       n_unread = 0;
    w->owing = 0; // (set again below only by a move down that stopped short)
    const uint64_t left     = sources_left(w->sources, w->n_sources, &n_unread);
    const int      heard    = kernel_reclaims(w->sources, w->n_sources);
    const uint64_t reserve  = pool->pressure.reserve_bytes;
    atomic_store(&pool->pressure.available_bytes, left);
    atomic_fetch_add(&pool->pressure.n_unread, n_unread);
    // events within a poll of the last cut were raised before its pages went back
    const int reclaim = heard && now - w->last_shrink_ns >= (uint64_t) w->interval_ns;
    if (heard) {
        atomic_fetch_add(&pool->pressure.n_events, 1);
    }
    if (!reclaim && (left == UINT64_MAX || (left >= reserve && left - reserve <= 3 * (reserve / 4)))) {
        return; // no limit, or the band where nothing moves: no lock taken
    }
    const uint64_t moved = atomic_load(&g_last_move_ns);
    if (!reclaim && moved != 0 && moved + 2 * (uint64_t) w->interval_ns > now && moved != w->last_shrink_ns &&
        moved != w->last_grow_ns) {
        return; // another pool of this process just moved: its pages are not in this reading yet
    }
    const int shrink = reclaim || left < reserve;
    if (!shrink) {
        if (pthread_mutex_trylock(&pool->lock) != 0) {
            return; // a remap runs: a move up waits for the next poll, never the decode for it
        }
    } else {
        pthread_mutex_lock(&pool->lock);
        const double waited = (double) (empanel_util_now_ns() - now) / 1e6;
        pool->pressure.max_lock_wait_ms = waited > pool->pressure.max_lock_wait_ms ? waited : pool->pressure.max_lock_wait_ms;
    }
    const uint64_t budget   = pool->budget.bytes;
    const uint64_t resident = pool->budget.resident_bytes;
    const uint64_t promised = budget > resident ? budget - resident : 0;
    const uint64_t ceiling  = pool->budget.ceiling_bytes != 0 ? pool->budget.ceiling_bytes : pool->budget.capacity_bytes;
    if (shrink) {
        uint64_t cut = left < reserve ? reserve - left + reserve / 2 : 0;
        if (reclaim && left >= reserve) { // (below the reserve the reading explains the reclaim)
            const uint64_t most = resident > reserve ? resident : reserve;
            const uint64_t grown = w->event_step + w->event_step / 2;
            w->event_step    = now - w->last_event_ns >= PRESSURE_EVENT_STREAK_NS ? reserve : grown < most ? grown : most;
            w->last_event_ns = now;
            cut = w->event_step > cut ? w->event_step : cut;
        }
        const int capped = cut > PRESSURE_MAX_STEP_BYTES;
        cut = capped ? PRESSURE_MAX_STEP_BYTES : cut;
        const uint64_t target = resident > cut ? resident - cut : 0;
        if (target < budget && budget > pool->budget.floor_bytes) {
            shrink_locked(w, target, now);
            w->owing = capped; // (a budget at the floor owes nothing more: no poll at once)
        }
    } else if (left > reserve && left - reserve > promised + 3 * (reserve / 4) && budget < ceiling &&
               now - w->last_shrink_ns >= PRESSURE_GROW_AFTER_SHRINK_NS && now - w->last_grow_ns >= PRESSURE_GROW_EVERY_NS) {
        const uint64_t up = left - reserve - promised - reserve / 2;
        empanel_budget_set_locked(pool, budget + up < ceiling ? budget + up : ceiling);
        pool->pressure.n_grows++;
        w->last_grow_ns = now;
        atomic_store(&g_last_move_ns, now);
    }
    pthread_mutex_unlock(&pool->lock);
}

// the next poll's time: the interval, or sooner when the kernel signals (or stop_fd is written)
static void wait_for_poll(struct empanel_watch * w) {
    struct pollfd fds[1 + EMPANEL_MAX_MEMORY_SOURCES];
    nfds_t n = 0;
    fds[n++] = (struct pollfd) { .fd = w->stop_fd, .events = POLLIN };
    for (int32_t i = 0; i < w->n_sources; i++) {
        if (w->sources[i].event_fd >= 0) {
            fds[n++] = (struct pollfd) { .fd = w->sources[i].event_fd, .events = POLLIN };
        }
    }
    const int ms = w->owing ? 0 : (int) (w->interval_ns / 1000000);
    while (poll(fds, n, ms) < 0 && errno == EINTR) {
    }
}

static int stopped(const struct empanel_watch * w) {
    struct pollfd p = { .fd = w->stop_fd, .events = POLLIN };
    return poll(&p, 1, 0) > 0;
}

static void * watch_main(void * arg) {
    struct empanel_watch * w = arg;
    while (!stopped(w)) {
        poll_once(w);
        wait_for_poll(w);
    }
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
    if (n_sources <= 0 || n_sources > EMPANEL_MAX_MEMORY_SOURCES || interval_ms <= 0 || interval_ms > 60000 ||
        reserve_bytes == 0 || reserve_bytes > EMPANEL_MAX_RESERVE_BYTES) {
        empanel_util_format_err(err, err_size, "watching memory: %d sources (1 to %d), every %d ms (1 to 60000), "
                                "keeping %llu bytes free (1 to %llu)", n_sources, EMPANEL_MAX_MEMORY_SOURCES,
                                interval_ms, (unsigned long long) reserve_bytes,
                                (unsigned long long) EMPANEL_MAX_RESERVE_BYTES);
        return -1;
    }
    struct empanel_watch * w = calloc(1, sizeof(*w));
    if (w == NULL) {
        empanel_util_format_err(err, err_size, "watching memory: out of memory");
        return -1;
    }
    w->pool        = pool;
    w->interval_ns = (int64_t) interval_ms * 1000000;
    w->stop_fd     = eventfd(0, EFD_CLOEXEC);
    if (w->stop_fd < 0 || open_sources(sources, n_sources, w->sources, &w->n_sources, 1, err, err_size) != 0) {
        if (w->stop_fd < 0) {
            empanel_util_format_err(err, err_size, "watching memory: no eventfd (%s)", strerror(errno));
        }
        close_if(w->stop_fd);
        free(w);
        return -1;
    }
    pool->pressure.reserve_bytes = reserve_bytes;
    for (int32_t i = 0; i < w->n_sources; i++) {
        pool->pressure.hears_kernel |= w->sources[i].event_fd >= 0;
    }
    pools_without_huge_pages(pool);
    if (pthread_create(&w->thread, NULL, watch_main, w) != 0) {
        empanel_util_format_err(err, err_size, "watching memory: no thread");
        close_sources(w->sources, w->n_sources);
        close(w->stop_fd);
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
    const uint64_t one = 1;
    while (write(w->stop_fd, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
    pthread_join(w->thread, NULL);
    close_sources(w->sources, w->n_sources);
    close(w->stop_fd);
    free(w);
    pool->pressure.watch = NULL;
}
