#pragma once

// empanel sidecar: the C side of empanel-gguf. Python (cffi, ABI mode) reads this header with the
// preprocessor lines removed, so keep declarations plain C, one per line.

#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(EMPANEL_BUILD)
#    define EMPANEL_API __declspec(dllexport)
#elif defined(_WIN32)
#    define EMPANEL_API __declspec(dllimport)
#else
#    define EMPANEL_API __attribute__((visibility("default")))
#endif

#define EMPANEL_SIDECAR_VERSION 1

EMPANEL_API int32_t empanel_sidecar_version(void);

#ifdef __cplusplus
}
#endif
