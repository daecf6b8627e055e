#pragma once

// util.c: the bottom of the units: a pool's first failure, error messages, the clock, the
// digest of verified reads (empanel_hash64 in empanel.h), a sort order

#include "empanel.h"

#include <stddef.h>
#include <stdint.h>

struct empanel_pool;

// the pool's first failure (later ones are dropped: the first is the cause); fails every later remap
void     empanel_util_set_error(struct empanel_pool * pool, const char * fmt, ...);
// the message into err [err_size] (nothing if err is NULL)
void     empanel_util_format_err(char * err, size_t err_size, const char * fmt, ...);
// CLOCK_MONOTONIC in nanoseconds
uint64_t empanel_util_now_ns(void);
uint64_t empanel_util_thread_cpu_ns(void); // CPU time of the calling thread
// qsort order of uint64_t, ascending
int      empanel_util_compare_uint64(const void * a, const void * b);
