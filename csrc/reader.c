// Reading experts: the sidecar's own file descriptors, pread straight into slot memory when the
// pool is plain host memory, else through a bounce buffer and llama_empanel_slot_write.

#include "empanel-impl.h"

#include "llama-empanel.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

uint64_t empanel_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

static int64_t stat_mtime_ns(const struct stat * st) {
#if defined(__APPLE__)
    return (int64_t) st->st_mtimespec.tv_sec * 1000000000ll + st->st_mtimespec.tv_nsec;
#else
    return (int64_t) st->st_mtim.tv_sec * 1000000000ll + st->st_mtim.tv_nsec;
#endif
}

int empanel_files_open(struct empanel_pool * pool, const char * const * paths, int32_t n_paths, char * err, size_t err_size) {
    pool->files = calloc(n_paths, sizeof(struct empanel_file));
    if (pool->files == NULL) {
        snprintf(err, err_size, "empanel: out of memory");
        return -1;
    }
    for (int32_t i = 0; i < n_paths; i++) {
        pool->files[i].fd = -1;
    }
    pool->n_files = n_paths;
    for (int32_t i = 0; i < n_paths; i++) {
        struct empanel_file * f = &pool->files[i];
        f->path = strdup(paths[i]);
        f->fd   = open(paths[i], O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (f->path == NULL || f->fd < 0 || fstat(f->fd, &st) != 0) {
            snprintf(err, err_size, "%s: cannot open for reading experts: %s", paths[i], strerror(errno));
            return -1;
        }
        f->size     = (uint64_t) st.st_size;
        f->mtime_ns = stat_mtime_ns(&st);
        f->inode    = (uint64_t) st.st_ino;
    }
    return 0;
}

void empanel_files_close(struct empanel_pool * pool) {
    for (int32_t i = 0; i < pool->n_files; i++) {
        if (pool->files[i].fd >= 0) {
            close(pool->files[i].fd);
        }
        free(pool->files[i].path);
    }
    free(pool->files);
    pool->files   = NULL;
    pool->n_files = 0;
}

// the files must be what they were at load: same size and modification time
int empanel_files_check(struct empanel_pool * pool) {
    for (int32_t i = 0; i < pool->n_files; i++) {
        const struct empanel_file * f = &pool->files[i];
        struct stat st;
        if (fstat(f->fd, &st) != 0) {
            empanel_set_error(pool, "%s: fstat failed: %s", f->path, strerror(errno));
            return -1;
        }
        if ((uint64_t) st.st_size != f->size || stat_mtime_ns(&st) != f->mtime_ns) {
            empanel_set_error(pool,
                "%s changed while the model was loaded (size %llu -> %llu bytes); reload the model",
                f->path, (unsigned long long) f->size, (unsigned long long) st.st_size);
            return -1;
        }
    }
    return 0;
}

// read exactly size bytes at offset, or record why not
static int pread_full(struct empanel_pool * pool, const struct empanel_file * f, void * dst, uint64_t size, uint64_t offset) {
    uint64_t done = 0;
    while (done < size) {
        const ssize_t n = pread(f->fd, (uint8_t *) dst + done, size - done, (off_t) (offset + done));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            empanel_set_error(pool, "%s: read of %llu bytes at offset %llu failed: %s",
                              f->path, (unsigned long long) size, (unsigned long long) offset, strerror(errno));
            return -1;
        }
        if (n == 0) {
            empanel_set_error(pool, "%s: short read at offset %llu (%llu of %llu bytes): file truncated?",
                              f->path, (unsigned long long) offset, (unsigned long long) done, (unsigned long long) size);
            return -1;
        }
        done += (uint64_t) n;
    }
    return 0;
}

int empanel_read_expert(struct empanel_pool * pool, const struct empanel_layer * layer, int32_t expert, int32_t slot) {
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        const struct empanel_tensor * t = &layer->tensors[i];
        if (t->pool == NULL) {
            empanel_set_error(pool, "%s: no slot pool bound", t->name);
            return -1;
        }
        const struct empanel_file * f = &pool->files[t->file];
        const uint64_t offset = t->offset + (uint64_t) expert * t->expert_size;
        const uint64_t t0 = empanel_now_ns();

        void * direct = llama_empanel_slot_data(t->pool, slot);
        void * dst    = direct != NULL ? direct : pool->bounce;
        if (pread_full(pool, f, dst, t->expert_size, offset) != 0) {
            return -1;
        }
        if (direct == NULL && llama_empanel_slot_write(t->pool, slot, pool->bounce, t->expert_size) != 0) {
            empanel_set_error(pool, "%s: writing expert %d into slot %d failed", t->name, expert, slot);
            return -1;
        }
        struct empanel_layer_stats * stats = (struct empanel_layer_stats *) &layer->stats;
        stats->bytes_read += t->expert_size;
        stats->read_ns    += empanel_now_ns() - t0;
    }
    return 0;
}
