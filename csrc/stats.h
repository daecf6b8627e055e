#pragma once

// stats.c: what a pool (and the library) reports (empanel.h): the version, the policies' names,
// the first failure and the notices, the counters of each layer, what the slots hold, the read
// path, the files' watch

#include "empanel.h"
