#pragma once

// remap.c: the remap hook (empanel_remap, empanel.h): a micro-batch's expert ids -> slots, the
// misses read first (or overlapped, ready.c), distinct experts beyond the slots in waves; and the
// policy lab's remap over the very same code (empanel_lab_access)

#include "empanel.h"
