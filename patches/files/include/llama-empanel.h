#pragma once

// empanel-gguf hooks: a small C API through which the empanel-gguf sidecar (expert slot pools,
// reader threads) connects to llama.cpp. Only hooks live here; the logic lives in empanel-gguf.
// No struct that the llama-cpp-python ctypes bindings mirror is changed by these hooks.

#include "llama.h"
#include "llama-empanel-shared.h" // constants, callback types, struct llama_empanel_pool_info

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

    LLAMA_API int32_t      llama_empanel_api_version(void);

    // the llama.cpp commit this library was built from (set by the empanel-gguf build)
    LLAMA_API const char * llama_empanel_llama_commit(void);

    //
    // expert slot pools
    //
    // A paged MoE layer's routed-expert weights (blk.N.ffn_{gate,up,down,gate_up}_exps.weight) are
    // never read at load and never allocated at full size: each becomes a pool tensor
    // [ne0, ne1, n_slots] in the buffer type the loader would have chosen, zero-filled. In the graph,
    // after the router's top-k, a remap op hands the expert ids of the micro-batch to `remap`,
    // which returns slot ids (making the experts resident first); MUL_MAT_ID runs over the pool
    // with the slot ids, while router weights, expert biases and scales keep the expert ids.
    //
    // Waves: a micro-batch whose tokens may route to more distinct experts than a pool holds
    // (n_tokens x n_used > n_slots) runs each pool's MUL_MAT_ID as a chain of n_waves calls, each
    // over the pairs routed to one wave's experts (the others get slot id -1, which the CPU
    // kernels skip) and writing into the previous call's output, so every (token, expert) pair is
    // computed once, by the same kernel, as in a resident layer. Pools that a GPU kernel may
    // compute on (device memory, or plain host memory in a build with a GPU backend, which op
    // offload may copy to the device) cannot skip pairs: their waves are masked instead. Each wave
    // multiplies every pair (the other waves' pairs over distinct slots of the token's that are
    // not in flight), its product times a 0/1 mask [1, n_used, n_tokens] is added to the sum, so
    // each element is one wave's value plus zeros: exact as well, at n_waves times the compute.

    // the plan for the next model load on this thread: layer il is paged with n_slots[il] slots;
    // 0: resident as usual; < 0: resident, and the remap hook sees its expert ids (and must
    // return them unchanged), e.g. to trace routing. A plan that pages a layer never maps the
    // file with MAP_POPULATE.
    LLAMA_API void llama_empanel_set_plan(
            const int32_t        * n_slots,
            int32_t                n_layer,
            llama_empanel_remap_fn remap,
            void                 * user);

    // the gate-ahead guess: while a paged layer runs a micro-batch that fits its pools, the next
    // `depth` paged layers' routers (with their input bias, gating and selection bias; no group
    // limit) are applied to this layer's FFN input, after this layer's remap, and their top-k
    // handed to `guess` as expert ids [n_tokens][n_used] for layer il, `distance` paged layers
    // ahead. Guesses never change what is computed. Call after llama_empanel_set_plan, before
    // the load; depth 0 (the default) builds none.
    LLAMA_API void llama_empanel_set_guess(llama_empanel_guess_fn guess, int32_t depth);

    // routing substitution (opt-in, inexact): in every paged layer whose gating gives scores
    // (softmax, sigmoid, sqrt(softplus)), the router's top n_used + n_alt choices and their
    // selection scores [n_expert, n_tokens] go to `subst` with the top-k ids [n_tokens][n_used],
    // which it may change in place (a routed expert that is not resident replaced by a resident
    // one among the next choices); the routing weights are then taken for the ids it leaves.
    // Call after llama_empanel_set_plan, before the load; NULL (the default) builds none.
    LLAMA_API void llama_empanel_set_subst(llama_empanel_subst_fn subst, int32_t n_alt);

    // reads that overlap the layer's compute: where a paged layer's micro-batch fits its pools
    // and a pool is in host memory, its MUL_MAT_ID first calls `ready` for that pool tensor (in
    // the graph's order, after the layer's remap), which returns once the experts the remap
    // placed in its slots hold their bytes; so the remap may return before its reads are done,
    // and one pool's reads go on while another's experts compute. Returns 0, or non-zero on
    // failure (the graph then runs on slot 0 and the caller's abort callback must stop it). Call
    // after llama_empanel_set_plan, before the load; NULL (the default) builds none.
    LLAMA_API void llama_empanel_set_ready(llama_empanel_ready_fn ready);

    // pinned pools: every paged layer whose pools hold all the model's experts (n_slots >=
    // n_expert) holds expert e in slot e from before its first graph computation on (the caller
    // preloads them so, and nothing evicts), so its graph is stock's: expert ids go to MUL_MAT_ID
    // as slot ids, with no remap, guess or substitution op. Call after llama_empanel_set_plan,
    // before the load; off by default.
    LLAMA_API void llama_empanel_set_pinned(bool pinned);

    // forget the plan (and any pools of a load that failed); call after the load returns
    LLAMA_API void llama_empanel_clear_plan(void);

    // number of pool tensors of a loaded model, and one by its GGUF tensor name: true and *info
    // filled (the tensor, its slots, its stride, whether its waves are masked), or false if that
    // tensor is not paged
    LLAMA_API int32_t llama_empanel_n_pools(const struct llama_model * model);
    LLAMA_API bool    llama_empanel_pool_info(const struct llama_model * model, const char * name,
                                              struct llama_empanel_pool_info * info);

    // the identity of file i (0: the first shard, then the others in split order) as llama.cpp's
    // loader opened it for the model (st_dev, st_ino), so that the sidecar checks that its own
    // descriptors name the same files. Returns the number of files the loader opened (0 for a
    // model without pools); *dev and *ino are set only for 0 <= i < that number
    LLAMA_API int32_t llama_empanel_model_file(const struct llama_model * model, int32_t i, uint64_t * dev, uint64_t * ino);

    // llama.cpp's programs: with EMPANEL_PLAN=<plan file> in the environment (written by
    // `empanel-gguf llama-server ...`), each load of the model that the plan names gets its slot
    // pools from the sidecar (EMPANEL_SIDECAR, else the libempanel next to this library), and a
    // computation during which an expert read failed fails (GGML_STATUS_FAILED, llama_decode: -3).
    // Prometheus text of those pools' counters ("" without any), for llama-server's /metrics.
    LLAMA_API const char * llama_empanel_program_metrics(void);
    // llama-server (patch 0014): true when an RPC host that ctx's backends run on was lost and
    // every such host answers again. A restarted ggml-rpc-server holds nothing of the old
    // connection, so the caller then loads the model and its contexts anew. Probes at most once a
    // second, each step waiting 1 s at most (the sidecar's probe, loaded for it); false when no host
    // was lost
    LLAMA_API bool llama_empanel_hosts_back(const struct llama_context * ctx);

    // the pool tensors are ordinary ggml tensors in ordinary backend buffers: empanel-gguf finds
    // their memory and writes their slots through ggml's public backend API (csrc/backend.c)
#ifdef __cplusplus
}
#endif
