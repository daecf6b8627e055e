#pragma once

// pressure.c: the controller that moves the live budget with the memory the machine has
// (empanel_pool_watch_memory, empanel_memory_available in empanel.h): a thread per elastic pool
// reading the binding memory limits, the budget down at once when memory runs low, up slowly
// when it is free again.

#include "empanel.h"

struct empanel_pool;

// the controller stops (its thread joined); nothing if there is none. pool.c calls it first of all
// at empanel_pool_free
void empanel_pressure_stop(struct empanel_pool * pool);
