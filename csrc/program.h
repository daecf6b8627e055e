#pragma once

// program.c: the hook API of llama.cpp's programs (empanel_program_*, empanel.h): libllama's
// program hook calls it around each model load that EMPANEL_PLAN names

#include "empanel.h"
