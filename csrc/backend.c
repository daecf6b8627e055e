// What the sidecar needs of ggml's public backend API: where a pool's slots lie (plain host
// memory, host memory of another layout, device memory), staging memory for device pools, and
// writing one expert into a slot. None of it needs llama.cpp's internals, so none of it is in the
// patch: the pool tensors are ordinary ggml tensors in ordinary backend buffers.

#include "backend.h"
#include "common.h"
#include "repack.h"

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

size_t empanel_struct_size(const char * name) {
    struct entry { const char * name; size_t size; };
    static const struct entry sizes[] = {
        { "llama_model_params",          sizeof(struct llama_model_params)          },
        { "llama_context_params",        sizeof(struct llama_context_params)        },
        { "llama_batch",                 sizeof(struct llama_batch)                 },
        { "llama_model_quantize_params", sizeof(struct llama_model_quantize_params) },
        { "llama_sampler_chain_params",  sizeof(struct llama_sampler_chain_params)  },
        { "llama_token_data",            sizeof(struct llama_token_data)            },
        { "llama_chat_message",          sizeof(struct llama_chat_message)          },
    };
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        if (strcmp(sizes[i].name, name) == 0) {
            return sizes[i].size;
        }
    }
    return 0;
}

void * empanel_backend_host_data(void * pool_tensor) {
    struct ggml_tensor * t = pool_tensor;
    if (t == NULL || t->buffer == NULL) {
        return NULL;
    }
    return llama_empanel_buffer_in_host_memory(t->buffer) ? t->data : NULL;
}

int empanel_backend_host_gives_back(void * pool_tensor) {
    struct ggml_tensor * t = pool_tensor;
    if (t == NULL || t->buffer == NULL) {
        return 0;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
    return dev == NULL || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
}

void * empanel_backend_slot_data(void * pool_tensor, int32_t slot) {
    struct ggml_tensor * t = pool_tensor;
    if (t == NULL || t->buffer == NULL || slot < 0 || slot >= t->ne[2]) {
        return NULL;
    }
    // plain host memory only (CPU, or a GPU backend's pinned host buffer): CPU_REPACK pools hold
    // another layout (tensor->extra), device pools are not mapped
    if (!ggml_backend_buffer_is_host(t->buffer) || t->extra != NULL) {
        return NULL;
    }
    return (char *) t->data + (size_t) slot * t->nb[2];
}

void * empanel_backend_host_buffer_alloc(void * pool_tensor, size_t size, void ** buffer) {
    struct ggml_tensor * t = pool_tensor;
    ggml_backend_buffer_type_t buft = NULL;
    if (t != NULL && t->buffer != NULL) {
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
        buft = dev != NULL ? ggml_backend_dev_host_buffer_type(dev) : NULL;
    }
    if (buft == NULL) {
        buft = ggml_backend_cpu_buffer_type();
    }
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, size);
    *buffer = buf;
    return buf != NULL ? ggml_backend_buffer_get_base(buf) : NULL;
}

void empanel_backend_host_buffer_free(void * buffer) {
    if (buffer != NULL) {
        ggml_backend_buffer_free(buffer);
    }
}

// ggml-cpu (patch 0003): repack one expert (i2) of a 3-D tensor in a CPU_REPACK buffer, found by
// name so that dynamically loaded CPU backends work too
typedef int (*repack_slice_fn)(struct ggml_tensor * t, const void * data, size_t size, int64_t i2);

static repack_slice_fn g_repack_slice = NULL;
static pthread_once_t  g_repack_once  = PTHREAD_ONCE_INIT;

static void repack_slice_find(void) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = dev != NULL ? ggml_backend_dev_backend_reg(dev) : NULL;
    g_repack_slice = reg != NULL ? (repack_slice_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_repack_set_slice") : NULL;
}

// looked up once, by the first of the reader threads that repack at the same time (ThreadSanitizer
// found the unguarded lookup racing)
static repack_slice_fn repack_slice(void) {
    pthread_once(&g_repack_once, repack_slice_find);
    return g_repack_slice;
}

int32_t empanel_backend_slot_write(void * pool_tensor, int32_t slot, const void * data, size_t size) {
    struct ggml_tensor * t = pool_tensor;
    if (t == NULL || t->buffer == NULL || slot < 0 || slot >= t->ne[2] || size != t->nb[2]) {
        return 1;
    }
    void * dst = empanel_backend_slot_data(t, slot);
    if (dst != NULL) {
        memcpy(dst, data, size);
        return 0;
    }
    if (t->extra != NULL && empanel_backend_host_data(t) != NULL) {
        // a CPU extra buffer type: CPU_REPACK holds the same bytes in another layout
        repack_slice_fn fn = repack_slice();
        return fn != NULL && fn(t, data, size, slot) == 0 ? 0 : 2;
    }
    ggml_backend_tensor_set(t, data, (size_t) slot * t->nb[2], size); // device memory
    return 0;
}

// whether repack.c has the layout ggml-cpu gives this tensor (checked against ggml's output before use)
static int own_repack_fits(const struct ggml_tensor * t) {
    return (t->type == GGML_TYPE_Q4_K || t->type == GGML_TYPE_Q2_K) && t->ne[0] % 256 == 0 && t->ne[1] % 8 == 0;
}

static void own_repack(const struct ggml_tensor * t, uint8_t * dst, const void * data) {
    if (t->type == GGML_TYPE_Q4_K) {
        empanel_repack_q4_K_8x8(dst, data, t->ne[1], t->ne[0] / 256);
    } else {
        empanel_repack_q2_K_8x8(dst, data, t->ne[1], t->ne[0] / 256);
    }
}

int32_t empanel_backend_slot_repack(void * pool_tensor, int32_t slot, const void * data, size_t size,
                                    atomic_int * own, int * by_own) {
    struct ggml_tensor * t = pool_tensor;
    *by_own = 0;
    if (t == NULL || t->buffer == NULL || t->extra == NULL || slot < 0 || slot >= t->ne[2] || size != t->nb[2]) {
        return empanel_backend_slot_write(pool_tensor, slot, data, size);
    }
    uint8_t * dst = (uint8_t *) t->data + (size_t) slot * t->nb[2]; // [nb[2]] bytes of ggml's layout
    if (atomic_load(own) == 2) {
        own_repack(t, dst, data);
        *by_own = 1;
        return 0;
    }
    int unchecked = 0;
    if (!own_repack_fits(t) || !atomic_compare_exchange_strong(own, &unchecked, 1)) {
        return empanel_backend_slot_write(pool_tensor, slot, data, size); // (3, or another thread checks)
    }
    const int32_t rc = empanel_backend_slot_write(pool_tensor, slot, data, size);
    uint8_t * mine = rc == 0 ? malloc(size) : NULL;
    if (mine != NULL) {
        own_repack(t, mine, data);
    }
    // an expert of one repeated byte (a hole in a sparse file) reads the same in any layout: it
    // proves nothing, so a later expert is checked instead
    const uint8_t * bytes = data;
    size_t same = 1;
    while (same < size && bytes[same] == bytes[0]) {
        same++;
    }
    atomic_store(own, mine == NULL || memcmp(mine, dst, size) != 0 ? 3 : same == size ? 0 : 2);
    free(mine);
    return rc;
}

int32_t empanel_offload_devices(void) {
    int32_t n = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        n += llama_empanel_device_is_gpu(dev) || llama_empanel_device_is_rpc(dev);
    }
    return n;
}

int32_t empanel_rpc_devices(void) {
    int32_t n = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        n += llama_empanel_device_is_rpc(ggml_backend_dev_get(i));
    }
    return n;
}

int32_t empanel_unified_devices(void) {
    int32_t n = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const char * reg = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
        n += llama_empanel_device_is_gpu(dev) && (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_IGPU ||
                                                  (reg != NULL && strcmp(reg, "MTL") == 0)); // Apple: unified
    }
    return n;
}

// give back the pages inside [ptr, ptr + size) (they read as zeros afterwards); with zero_edges
// also zero the bytes of the partial pages at both ends
int empanel_backend_memory_release(uint8_t * ptr, uint64_t size, int zero_edges) {
    const uint64_t page  = (uint64_t) sysconf(_SC_PAGESIZE);
    const uint64_t begin = ((uint64_t) (uintptr_t) ptr + page - 1) / page * page;
    const uint64_t end   = ((uint64_t) (uintptr_t) ptr + size) / page * page;
    if (begin >= end) {
        if (zero_edges) {
            memset(ptr, 0, size);
        }
        return 0;
    }
    if (zero_edges) {
        memset(ptr, 0, begin - (uintptr_t) ptr);
        memset((uint8_t *) (uintptr_t) end, 0, (uintptr_t) ptr + size - end);
    }
#if defined(__linux__)
    if (madvise((void *) (uintptr_t) begin, end - begin, MADV_DONTNEED) == 0) {
        return 1; // private anonymous memory: zero-filled on the next touch
    }
#endif
    if (zero_edges) {
        memset((void *) (uintptr_t) begin, 0, end - begin);
    }
    return -1;
}
