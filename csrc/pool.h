#pragma once

// pool.c: a pool's lifecycle (empanel_pool_init / _free, empanel_lab_init / _free, empanel.h):
// its tables, files, reader and g-lru made and freed; bound to llama.cpp's pool tensors; its
// digests; recovery from a failure (empanel_pool_clear_error)

#include "empanel.h"
#include "llama-empanel-shared.h"

#include <stdint.h>

struct empanel_pool;

// after the model is loaded, the pool tensor llama.cpp made for the expert tensor of
// GGUF name `name` (info NULL: it made none). 0, or -1 (reason in empanel_pool_error)
int32_t empanel_pool_bind(struct empanel_pool * pool, const char * name, const struct llama_empanel_pool_info * info);
