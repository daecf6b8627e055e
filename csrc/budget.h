#pragma once

// budget.c: the live budget of g-lru pools (empanel_pool_set_budget, empanel_pool_budget,
// empanel.h): the bytes of resident experts over all layers, moved at run time; a lower one gives
// slots back at once, their pages to the kernel.

#include "empanel.h"
