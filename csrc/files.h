#pragma once

// files.c: the model files of a pool (struct empanel_files, state.h): opened (O_DIRECT where the
// filesystem takes it), watched for writes (inotify, else size/mtime/ctime checks), closed;
// empanel_pool_watching (stats.c) reports the watch

#include <stddef.h>
#include <stdint.h>

struct empanel_pool;

int      empanel_files_open  (struct empanel_pool * pool, const char * const * paths, int32_t n_paths, int direct_io, char * err, size_t err_size);
void     empanel_files_close (struct empanel_pool * pool);
int      empanel_files_check (struct empanel_pool * pool);
// file i of the pool is the one llama.cpp's loader read (its st_dev and st_ino); 0, or -1 with the
// reason in err (a file replaced at its path between the two opens)
int      empanel_files_match     (struct empanel_pool * pool, int32_t i, uint64_t dev, uint64_t ino, char * err,
                              size_t err_size);
