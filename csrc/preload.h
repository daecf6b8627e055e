#pragma once

// preload.c: filling the empty slots of every paged layer at load (empanel_preload and
// empanel_preload_order, empanel.h), in a profile's order or by id

#include "empanel.h"

#include <stddef.h>

struct empanel_pool;

// after the preload of a pinned plan, every pool that holds all the experts holds
// expert e in slot e; 0, or -1 with the reason in err
int empanel_preload_check_pinned(struct empanel_pool * pool, char * err, size_t err_size);
