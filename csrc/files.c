// The model files as the sidecar holds them: its own descriptors (buffered and O_DIRECT), and
// the check that they are still what they were at load.
//
// Linux: one inotify instance per pool watches every file for writes and truncations (any
// process, any mtime). Elsewhere, or where inotify is refused (no instances left, a file system
// without it, EMPANEL_FILE_WATCH=0), empanel_files_check compares size, mtime and ctime.
// A rename over the path or a deletion is no change: our descriptors (and llama.cpp's mapping)
// keep the file that was loaded.

#include "files.h"
#include "util.h"
#include "state.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__linux__)
#    include <sys/inotify.h>
#endif

static int64_t timespec_ns(const struct timespec * ts) {
    return (int64_t) ts->tv_sec * 1000000000ll + ts->tv_nsec;
}

static int64_t stat_mtime_ns(const struct stat * st) {
#if defined(__APPLE__)
    return timespec_ns(&st->st_mtimespec);
#else
    return timespec_ns(&st->st_mtim);
#endif
}

// the inode change time: set by the kernel on every write, truncation, utime() and chmod, and
// never settable by a user, so a restored mtime does not hide a rewrite from it
static int64_t stat_ctime_ns(const struct stat * st) {
#if defined(__APPLE__)
    return timespec_ns(&st->st_ctimespec);
#else
    return timespec_ns(&st->st_ctim);
#endif
}

static void files_watch(struct empanel_pool * pool);

// an fd that bypasses the page cache, or -1 where the file system refuses it
static int open_direct(const char * path) {
#if defined(O_DIRECT)
    return open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
#else
    int fd = open(path, O_RDONLY | O_CLOEXEC);
#    if defined(__APPLE__)
    if (fd >= 0) {
        fcntl(fd, F_NOCACHE, 1); // macOS: no O_DIRECT; F_NOCACHE needs no alignment
    }
#    endif
    return fd;
#endif
}

int empanel_files_open(struct empanel_pool * pool, const char * const * paths, int32_t n_paths, int direct_io,
                       char * err, size_t err_size) {
    pool->files.list = calloc(n_paths, sizeof(struct empanel_file));
    if (pool->files.list == NULL) {
        snprintf(err, err_size, "empanel: out of memory");
        return -1;
    }
    for (int32_t i = 0; i < n_paths; i++) {
        pool->files.list[i].fd        = -1;
        pool->files.list[i].fd_direct = -1;
    }
    pool->files.n = n_paths;
    for (int32_t i = 0; i < n_paths; i++) {
        struct empanel_file * f = &pool->files.list[i];
        f->path = strdup(paths[i]);
        f->fd   = open(paths[i], O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (f->path == NULL || f->fd < 0 || fstat(f->fd, &st) != 0) {
            snprintf(err, err_size, "%s: cannot open for reading experts: %s", paths[i], strerror(errno));
            return -1;
        }
        f->size     = (uint64_t) st.st_size;
        f->mtime_ns = stat_mtime_ns(&st);
        f->ctime_ns = stat_ctime_ns(&st);
        f->watch    = -1;
        if (direct_io) {
            f->fd_direct = open_direct(paths[i]);
            if (f->fd_direct < 0 && pool->notice[0] == '\0') {
                snprintf(pool->notice, sizeof(pool->notice),
                         "%s: O_DIRECT refused (%s); experts are read through the page cache",
                         paths[i], strerror(errno));
            }
        }
    }
    files_watch(pool);
    return 0;
}

void empanel_files_close(struct empanel_pool * pool) {
    if (pool->files.watch_fd >= 0) {
        close(pool->files.watch_fd);
        pool->files.watch_fd = -1;
    }
    for (int32_t i = 0; i < pool->files.n; i++) {
        if (pool->files.list[i].fd >= 0) {
            close(pool->files.list[i].fd);
        }
        if (pool->files.list[i].fd_direct >= 0) {
            close(pool->files.list[i].fd_direct);
        }
        free(pool->files.list[i].path);
    }
    free(pool->files.list);
    pool->files.list   = NULL;
    pool->files.n = 0;
}

// watch every file for writes, or leave watch_fd at -1 (the stat checks)
static void files_watch(struct empanel_pool * pool) {
    pool->files.watch_fd = -1;
#if defined(__linux__)
    const char * env = getenv("EMPANEL_FILE_WATCH");
    if (env != NULL && strcmp(env, "0") == 0) {
        return;
    }
    const int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0) {
        return;
    }
    for (int32_t i = 0; i < pool->files.n; i++) {
        struct empanel_file * f = &pool->files.list[i];
        f->watch = inotify_add_watch(fd, f->path, IN_MODIFY);
        struct stat by_path;
        struct stat by_fd;
        // the path must still name the file we opened, else we would watch another one
        if (f->watch < 0 || stat(f->path, &by_path) != 0 || fstat(f->fd, &by_fd) != 0 ||
            by_path.st_ino != by_fd.st_ino || by_path.st_dev != by_fd.st_dev) {
            close(fd);
            return;
        }
    }
    pool->files.watch_fd = fd;
#endif
}

int empanel_files_match(struct empanel_pool * pool, int32_t i, uint64_t dev, uint64_t ino, char * err, size_t err_size) {
    const struct empanel_file * f = &pool->files.list[i];
    struct stat st;
    if (fstat(f->fd, &st) != 0) {
        empanel_util_format_err(err, err_size, "%s: fstat failed: %s", f->path, strerror(errno));
        return -1;
    }
    if ((uint64_t) st.st_dev != dev || (uint64_t) st.st_ino != ino) {
        empanel_util_format_err(err, err_size, "%s was replaced between empanel-gguf's open and llama.cpp's (another "
                                "file now has its path): the dense weights would come from one file and the "
                                "experts from another; load the model again", f->path);
        return -1;
    }
    return 0;
}

// the file that inotify watch descriptor wd belongs to, or -1
static int32_t file_of_watch(const struct empanel_pool * pool, int wd) {
    for (int32_t i = 0; i < pool->files.n; i++) {
        if (pool->files.list[i].watch == wd) {
            return i;
        }
    }
    return -1;
}

// events since the last look: the first file written to (or 0 if the queue overflowed), else -1.
// A watch the kernel dropped (IN_IGNORED: file system unmounted) ends watching: the stat checks
// take over.
static int32_t watch_poll(struct empanel_pool * pool) {
#if defined(__linux__)
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    for (;;) {
        const ssize_t n = read(pool->files.watch_fd, buf, sizeof(buf));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return -1; // EAGAIN: nothing happened
        }
        for (char * p = buf; p < buf + n; ) {
            const struct inotify_event * ev = (const struct inotify_event *) p;
            if (ev->mask & IN_Q_OVERFLOW) {
                return 0;
            }
            if (ev->mask & IN_MODIFY) {
                const int32_t i = file_of_watch(pool, ev->wd);
                return i >= 0 ? i : 0;
            }
            if (ev->mask & IN_IGNORED) {
                close(pool->files.watch_fd);
                pool->files.watch_fd = -1;
                return -1;
            }
            p += sizeof(struct inotify_event) + ev->len;
        }
    }
#else
    (void) pool;
    return -1;
#endif
}

// the files must be what they were at load. Watched: nothing written since. Otherwise: the same
// size, mtime and ctime. A change is for good: every later check fails too.
int empanel_files_check(struct empanel_pool * pool) {
    if (pool->files.changed < 0 && pool->files.watch_fd >= 0) {
        const int32_t i = watch_poll(pool);
        if (i >= 0) {
            pool->files.changed = i;
            snprintf(pool->files.changed_why, sizeof(pool->files.changed_why), "was written to");
        }
    }
    for (int32_t i = 0; pool->files.changed < 0 && pool->files.watch_fd < 0 && i < pool->files.n; i++) {
        const struct empanel_file * f = &pool->files.list[i];
        struct stat st;
        if (fstat(f->fd, &st) != 0) {
            empanel_util_set_error(pool, "%s: fstat failed: %s", f->path, strerror(errno));
            return -1;
        }
        if ((uint64_t) st.st_size != f->size) {
            pool->files.changed = i;
            snprintf(pool->files.changed_why, sizeof(pool->files.changed_why), "changed size (%llu -> %llu bytes)",
                     (unsigned long long) f->size, (unsigned long long) st.st_size);
        } else if (stat_mtime_ns(&st) != f->mtime_ns || stat_ctime_ns(&st) != f->ctime_ns) {
            pool->files.changed = i;
            snprintf(pool->files.changed_why, sizeof(pool->files.changed_why), "has a new %s time",
                     stat_mtime_ns(&st) != f->mtime_ns ? "modification" : "inode change");
        }
    }
    if (pool->files.changed >= 0) {
        empanel_util_set_error(pool, "%s changed while the model was loaded (it %s); its experts can no "
                               "longer be trusted: reload the model", pool->files.list[pool->files.changed].path,
                               pool->files.changed_why);
        return -1;
    }
    return 0;
}
