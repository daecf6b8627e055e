#pragma once

// internal side of the empanel hooks (include/llama-empanel.h): what llama.cpp's patched loader,
// model, graph builder and context call (each line says which). Defined in:
//   llama-empanel.cpp          the plan of the load on this thread, the loader's questions
//   llama-empanel-pools.cpp    the pools allocated at the end of a load
//   llama-empanel-registry.cpp loaded models' pools, the graph lock
//   llama-empanel-graph.cpp    the ops over pools: remap, waves, ready, guess, substitution; the
//                              node budget
//   llama-empanel-program.cpp  llama.cpp's programs on pools (EMPANEL_PLAN, the sidecar)
//   llama-empanel-rpc.cpp      RPC hosts lost during a decode
// What only our own sources share is in llama-empanel-state.h.

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include "llama-mmap.h"

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

struct llama_model;

using llama_empanel_ctxs_bufs = std::vector<std::pair<ggml_context_ptr, std::vector<ggml_backend_buffer_ptr>>>;

// loader: the plan of the load running on this thread pages some layer
bool llama_empanel_plan_active();

// loader: slots for this tensor of the current load if it is a paged routed-expert weight, else 0;
// file_offset: where its data starts in its file (bytes), the phase its pool is placed at
int32_t llama_empanel_n_slots(const char * name, const ggml_tensor * meta, size_t file_offset);

// loader: remember a resident routed-expert weight of a layer the plan observes (n_slots < 0)
void llama_empanel_observe(ggml_tensor * t);

// loader: the context that holds the pool tensors of buffer type buft for the current load
ggml_context * llama_empanel_pool_ctx(ggml_backend_buffer_type_t buft);

// model: allocate and zero the current load's pools, hand them to the model's buffers
// (ctxs_bufs) and register them for the graph, with the identity of the files the loader read
// (files: its open files, for llama_empanel_model_file)
void llama_empanel_alloc_pools(const llama_model * model, bool no_alloc, llama_empanel_ctxs_bufs & ctxs_bufs,
                               const llama_files & files);

// model: forget a model's pools (its buffers are freed with the model)
void llama_empanel_model_free(const llama_model * model);

// graph: w is a pool tensor that holds only some experts (not observed, not pinned)
bool llama_empanel_is_pool(const ggml_tensor * w);

// graph: slot ids [n_used, n_tokens] for MUL_MAT_ID over pool w, or ids itself if w is no pool
ggml_tensor * llama_empanel_build_remap(ggml_context * ctx, const ggml_tensor * w, ggml_tensor * ids);

// graph: the gate-ahead guesses of the paged layers after pool w's (llama_empanel_set_guess):
// their routers applied to cur, the FFN input of w's layer [n_embd, n_tokens], handed over by ops
// that pass slot_ids (w's layer's remap) through, so that they run after it and before the
// layer's experts; returns the slot ids to use (slot_ids itself without guesses)
ggml_tensor * llama_empanel_build_guess(ggml_context * ctx, const ggml_tensor * w, ggml_tensor * cur, ggml_tensor * slot_ids,
                                        int gating_op, int64_t n_used);

// graph: the top-k ids of pool w's layer after routing substitution (llama_empanel_set_subst), or
// selected itself; scores [n_expert, n_tokens] are the layer's selection scores
ggml_tensor * llama_empanel_build_subst(ggml_context * ctx, const ggml_tensor * w, ggml_tensor * scores,
                                        ggml_tensor * selected, int gating_op, int64_t n_used);

// graph: the expert ids that a slot-id tensor was made from (ids itself if it is none)
ggml_tensor * llama_empanel_expert_ids(ggml_tensor * ids);

// graph: MUL_MAT_ID of w; over a pool with expert ids (a micro-batch in waves) a chain of one
// remap and one MUL_MAT_ID per wave, each writing its pairs into the previous one's output (masked
// pools: each masked product added to the previous ones' sum)
ggml_tensor * llama_empanel_mul_mat_id(ggml_context * ctx, ggml_tensor * w, ggml_tensor * cur, ggml_tensor * ids);

// graph: fn on each MUL_MAT_ID of a llama_empanel_mul_mat_id result (every wave's), so that
// precision settings reach them all; on res itself if it is no chain of ours
void llama_empanel_each_mul_mat_id(ggml_tensor * res, const std::function<void(ggml_tensor *)> & fn);

// loader: a plan is set on this thread (llama_empanel_set_plan)
bool llama_empanel_plan_set();

// load (llama-empanel-program.cpp): before loading path_model, the plan in the environment if it
// is this model's (*prog, else nullptr; never for a vocab_only load); false if it is but cannot be
// used (said on stderr)
bool llama_empanel_program_begin(const std::string & path_model, bool vocab_only, void ** prog);

// load: after it (model nullptr if it failed): bind the pools; false if that failed (logged), and
// the caller frees the model. A no_alloc load (a program sizing its memory) has no pool memory:
// nothing is bound or preloaded, the plan only sized its pools
bool llama_empanel_program_end(void * prog, const llama_model * model, bool no_alloc);

// model: the end of a model loaded with a program plan (statistics written, pools freed)
void llama_empanel_program_close(const llama_model * model);

// context: status of a graph computation, GGML_STATUS_FAILED if an expert read failed during it
ggml_status llama_empanel_program_status(const llama_model * model, ggml_status status);

// context: after a decode, false if an RPC host that one of sched's backends runs on was lost or
// timed out during it (ggml-rpc, patch 0008: its outputs are zeros, not the model's). Only a
// sched with RPC backends is synchronized to know.
bool llama_empanel_hosts_ok(ggml_backend_sched_t sched);

// llama_empanel_hosts_back: every lost host of "HOST:PORT,..." answers a handshake again (the
// sidecar probes, at most once a second; loaded for it, plan or not); false without the sidecar
// (llama-empanel-program.cpp)
bool llama_empanel_program_hosts_back(const std::string & endpoints);

// context: a graph computation over the model's pools begins; returns what
// llama_empanel_graph_end takes after it (nullptr for a model without paged pools). One graph at a
// time computes over a model's paged pools, so that two contexts on one model (two threads, or
// MTP drafting's second context) each see the pools as if alone
void * llama_empanel_graph_begin(const llama_model * model);
// context: the computation ended (its device work is waited for first)
void   llama_empanel_graph_end(void * graph, ggml_backend_sched_t sched);

// context: graph nodes the waves of a micro-batch of n_tokens add to a model's graph (upper bound)
uint32_t llama_empanel_graph_extra_nodes(const llama_model * model, uint32_t n_tokens);
