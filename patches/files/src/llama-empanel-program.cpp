// empanel hooks for llama.cpp's own programs (llama-server, llama-cli, llama-bench,
// llama-perplexity): with EMPANEL_PLAN=<plan file> in the environment, each load of the model
// that the plan names gets the plan's expert slot pools. The work is the sidecar's (empanel-gguf's
// libempanel, csrc/load.c): this file loads it (EMPANEL_SIDECAR, else the libempanel next to
// this libllama) and calls it around the load, at each graph computation and at the model's end.

#include "llama-empanel.h"
#include "llama-empanel-impl.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#if !defined(_WIN32)
#include <dlfcn.h>
#endif

namespace {

// the sidecar's program API (csrc/empanel.h); a program (its struct empanel_load *) and a pool
// (struct empanel_pool *) are opaque here
struct llama_empanel_sidecar {
    void *       (*open)       (const char * plan_path, const char * model_path, char * err, size_t err_size);
    int32_t      (*loaded)     (void * prog, const llama_model * model, char * err, size_t err_size);
    void *       (*pool)       (void * prog);
    void         (*close)      (void * prog);
    size_t       (*metrics)    (char * buf, size_t size);
    bool         (*failed)     (void * pool);
    const char * (*error)      (void * pool);
    void         (*clear_error)(void * pool);
    int32_t      (*hosts_back) (const char * endpoints);
};

std::mutex                            g_program_mutex;
std::map<const llama_model *, void *> g_programs; // model -> its program (struct empanel_load *)
std::atomic<const llama_empanel_sidecar *> g_sidecar{nullptr}; // set once, read by any thread (/metrics)

#if !defined(_WIN32)
// the sidecar library, loaded once; nullptr with the reason in err
const llama_empanel_sidecar * llama_empanel_sidecar_get(std::string & err) {
    static std::once_flag        once;
    static llama_empanel_sidecar api;
    static std::string           failure;
    std::call_once(once, [] {
        std::string path;
        const char * given = getenv("EMPANEL_SIDECAR");
        if (given != nullptr && *given != '\0') {
            path = given;
        } else {
            Dl_info info;  // libempanel next to this libllama
            if (dladdr((void *) &llama_empanel_program_metrics, &info) != 0 && info.dli_fname != nullptr) {
                path = info.dli_fname;
                path = path.substr(0, path.find_last_of('/') + 1);
            }
#if defined(__APPLE__)
            path += "libempanel.dylib";
#else
            path += "libempanel.so";
#endif
        }
        void * lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (lib == nullptr) {
            failure = std::string("cannot load the sidecar (EMPANEL_SIDECAR): ") + dlerror();
            return;
        }
        struct { const char * name; void ** fn; } syms[] = {
            { "empanel_program_open",     (void **) &api.open        },
            { "empanel_program_loaded",   (void **) &api.loaded      },
            { "empanel_load_pool",        (void **) &api.pool        },
            { "empanel_program_close",    (void **) &api.close       },
            { "empanel_program_metrics",  (void **) &api.metrics     },
            { "empanel_pool_failed",      (void **) &api.failed      },
            { "empanel_pool_error",       (void **) &api.error       },
            { "empanel_pool_clear_error", (void **) &api.clear_error },
            { "empanel_rpc_hosts_back",   (void **) &api.hosts_back  },
        };
        for (auto & sym : syms) {
            *sym.fn = dlsym(lib, sym.name);
            if (*sym.fn == nullptr) {
                failure = path + " has no " + sym.name + ": it is from another empanel-gguf build";
                return;
            }
        }
        g_sidecar.store(&api);
    });
    err = failure;
    return g_sidecar.load();
}
#else
const llama_empanel_sidecar * llama_empanel_sidecar_get(std::string & err) {
    err = "llama.cpp's programs on slot pools are not supported on Windows yet";
    return nullptr;
}
#endif

// on stderr, whatever the program does with llama.cpp's log (llama-bench silences it)
void llama_empanel_report(const char * what) {
    fprintf(stderr, "empanel: %s\n", what);
}

void * llama_empanel_program_of(const llama_model * model) {
    std::lock_guard<std::mutex> lock(g_program_mutex);
    auto it = g_programs.find(model);
    return it == g_programs.end() ? nullptr : it->second;
}

} // namespace

bool llama_empanel_program_begin(const std::string & path_model, bool vocab_only, void ** prog) {
    *prog = nullptr;
    const char * plan = getenv("EMPANEL_PLAN");
    if (plan == nullptr || *plan == '\0' || path_model.empty() || vocab_only || llama_empanel_plan_set()) {
        return true; // no plan handed over, no tensors to page, or a plan set on this thread by the caller
    }
    std::string why;
    const llama_empanel_sidecar * api = llama_empanel_sidecar_get(why);
    if (api == nullptr) {
        llama_empanel_report(why.c_str());
        return false;
    }
    char err[512] = "";
    *prog = api->open(plan, path_model.c_str(), err, sizeof(err));
    if (*prog == nullptr && err[0] != '\0') {
        llama_empanel_report(err);
        return false;
    }
    return true; // *prog nullptr: the plan is another model's
}

bool llama_empanel_program_end(void * prog, const llama_model * model, bool no_alloc) {
    if (prog == nullptr) {
        return true;
    }
    llama_empanel_clear_plan();
    std::string why;
    const llama_empanel_sidecar * api = llama_empanel_sidecar_get(why);
    char err[512] = "";
    if (model == nullptr || (!no_alloc && api->loaded(prog, model, err, sizeof(err)) != 0)) {
        if (model != nullptr) {
            llama_empanel_report(err);
        }
        api->close(prog);
        return false;
    }
    std::lock_guard<std::mutex> lock(g_program_mutex);
    g_programs[model] = prog;
    return true;
}

void llama_empanel_program_close(const llama_model * model) {
    void * prog = nullptr;
    {
        std::lock_guard<std::mutex> lock(g_program_mutex);
        auto it = g_programs.find(model);
        if (it == g_programs.end()) {
            return;
        }
        prog = it->second;
        g_programs.erase(it);
    }
    g_sidecar.load()->close(prog);
}

ggml_status llama_empanel_program_status(const llama_model * model, ggml_status status) {
    void * prog = llama_empanel_program_of(model);
    if (prog == nullptr) {
        return status;
    }
    const llama_empanel_sidecar * api = g_sidecar.load();
    void * pool = api->pool(prog);
    if (!api->failed(pool)) {
        return status;
    }
    // a read failed (or the file changed): this computation's outputs are not the model's
    llama_empanel_report(api->error(pool));
    api->clear_error(pool);
    return GGML_STATUS_FAILED;
}

bool llama_empanel_program_hosts_back(const std::string & endpoints) {
    std::string why;
    const llama_empanel_sidecar * api = llama_empanel_sidecar_get(why); // loaded now without a plan
    return api != nullptr && api->hosts_back(endpoints.c_str()) == 1;
}

const char * llama_empanel_program_metrics(void) {
    static thread_local std::string text;
    text.clear();
    const llama_empanel_sidecar * api = g_sidecar.load();
    if (api == nullptr) {
        return "";
    }
    size_t n = api->metrics(nullptr, 0);
    for (;;) {
        text.resize(n + 1);
        const size_t got = api->metrics(&text[0], text.size());
        if (got <= n) {
            text.resize(got);
            return text.c_str();
        }
        n = got; // grew in between
    }
}
