#pragma once

// What libllama's empanel hooks and the empanel-gguf sidecar (libempanel) share: constants, the
// callback types the sidecar implements, what a pool tensor is at bind, and the three predicates
// both sides must answer alike. Nothing here is a call into the other library: each reads this
// header, and only the sidecar's csrc/load.c calls libllama (through include/llama-empanel.h).

#include "ggml-backend.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

// bumped whenever a hook, a callback type or the struct below changes; empanel-gguf refuses a
// library with another version
#define LLAMA_EMPANEL_API_VERSION 12

// the O_DIRECT block of the sidecar's reads, bytes: plain host pools are placed at their file
// offset modulo this so that reads land in their slots
#define LLAMA_EMPANEL_READ_ALIGN 4096

// experts one wave holds at most in a pool of n_slots: half of it, so that the next wave's
// experts can be read into the other half while this one computes
#define LLAMA_EMPANEL_WAVE_EXPERTS(n_slots) ((n_slots) >= 2 ? (n_slots) / 2 : 1)

// expert ids [n_tokens][n_used] (row i at expert_ids + i*ids_row_stride) -> slot ids, written
// contiguously to slot_ids [n_tokens][n_used]. pool == NULL: one call for all the layer's pools
// (one wave); else the call for wave `wave` of `n_waves` of that pool tensor only, with -1 for
// the pairs of other waves. Returns 0, or non-zero on failure (the graph then runs on slot 0
// and the caller's abort callback must stop it).
typedef int32_t (*llama_empanel_remap_fn)(
        void                     * user,
        int32_t                    il,
        const struct ggml_tensor * pool,
        int32_t                    wave,
        int32_t                    n_waves,
        const int32_t            * expert_ids,
        int64_t                    ids_row_stride,
        int32_t                  * slot_ids,
        int32_t                    n_used,
        int32_t                    n_tokens);

// the gate-ahead guess of layer il, `distance` paged layers ahead: expert ids [n_tokens][n_used]
typedef int32_t (*llama_empanel_guess_fn)(
        void          * user,
        int32_t         il,
        int32_t         distance,
        const int32_t * expert_ids,
        int64_t         ids_row_stride,
        int32_t         n_used,
        int32_t         n_tokens);

// routing substitution (llama_empanel_set_subst): may change expert_ids in place
typedef int32_t (*llama_empanel_subst_fn)(
        void          * user,
        int32_t         il,
        int32_t       * expert_ids,
        int64_t         ids_row_stride,
        int32_t         n_used,
        const int32_t * candidates,
        int64_t         cand_row_stride,
        int32_t         n_cand,
        const float   * scores,
        int64_t         scores_row_stride,
        int32_t         n_tokens);

// pool's MUL_MAT_ID is about to run (llama_empanel_set_ready): returns once its reads landed
typedef int32_t (*llama_empanel_ready_fn)(
        void                     * user,
        int32_t                    il,
        const struct ggml_tensor * pool);

// one pool tensor as llama.cpp made it, handed to the sidecar at bind (llama_empanel_pool_info)
struct llama_empanel_pool_info {
    struct ggml_tensor * tensor;     // [ne0, ne1, n_slots]
    int64_t              n_slots;    // ne[2], or -1 if the tensor is not three-dimensional
    uint64_t             slot_bytes; // nb[2]: bytes from one slot to the next
    bool                 masked;     // its waves are masked: kernels read every slot while a wave
                                     // computes, so no slot of it may be written then
};

// a backend buffer in this process's host memory, of any layout: plain host memory, or a CPU
// extra buffer type (CPU_REPACK), which is host memory that does not say so (is_host is for
// the plain layout) but belongs to the CPU device
static inline bool llama_empanel_buffer_in_host_memory(ggml_backend_buffer_t buf) {
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(buf));
    return ggml_backend_buffer_is_host(buf) || (dev != NULL && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU);
}

// a device of an RPC server (its backend registry is ggml-rpc's)
static inline bool llama_empanel_device_is_rpc(ggml_backend_dev_t dev) {
    const char * reg = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
    return reg != NULL && strcmp(reg, "RPC") == 0;
}

// a GPU (or integrated GPU) of this process: op offload may take plain host pools' MUL_MAT_IDs
// to it. An RPC server's device is none: it never offloads, and its pools are device pools
static inline bool llama_empanel_device_is_gpu(ggml_backend_dev_t dev) {
    const enum ggml_backend_dev_type type = ggml_backend_dev_type(dev);
    return (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) &&
           !llama_empanel_device_is_rpc(dev);
}

#ifdef __cplusplus
}
#endif
