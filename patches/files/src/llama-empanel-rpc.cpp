// empanel hooks, RPC hosts: after a decode, whether an RPC host that one of the context's backends
// runs on was lost or timed out during it (ggml-rpc, patches 0008 and 0010); and whether every
// host it lost answers again, so that llama-server loads the model anew on them (patch 0014)

#include "llama-empanel.h"
#include "llama-empanel-impl.h"

#include "llama-context.h"
#include "llama-impl.h"

#include "ggml-backend.h"

#include <string>

typedef bool (*llama_empanel_rpc_backend_failed_fn)(ggml_backend_t backend);

// the RPC registry and patch 0008's "has this backend's connection failed", looked up once (ggml
// registers its built-in backends at start; RPC servers add devices to the RPC registry, not
// registries of their own to look for); failed is nullptr without RPC
static ggml_backend_reg_t llama_empanel_rpc_reg(llama_empanel_rpc_backend_failed_fn * failed) {
    static const ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    static const auto fn = reg == nullptr ? nullptr :
        (llama_empanel_rpc_backend_failed_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_backend_failed");
    *failed = fn;
    return reg;
}

static bool llama_empanel_on_rpc_host(ggml_backend_t backend, ggml_backend_reg_t reg) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    return dev != nullptr && ggml_backend_dev_backend_reg(dev) == reg;
}

bool llama_empanel_hosts_ok(ggml_backend_sched_t sched) {
    llama_empanel_rpc_backend_failed_fn failed = nullptr;
    const ggml_backend_reg_t reg = llama_empanel_rpc_reg(&failed);
    if (failed == nullptr) {
        return true;
    }
    bool synced = false;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); i++) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
        if (!llama_empanel_on_rpc_host(backend, reg)) {
            continue;
        }
        if (!synced) { // the batch's last commands (its outputs among them) may still be under way
            ggml_backend_sched_synchronize(sched);
            synced = true;
        }
        if (failed(backend)) {
            return false;
        }
    }
    return true;
}

bool llama_empanel_hosts_back(const llama_context * ctx) {
    llama_empanel_rpc_backend_failed_fn failed = nullptr;
    const ggml_backend_reg_t reg = llama_empanel_rpc_reg(&failed);
    if (ctx == nullptr || failed == nullptr) {
        return false;
    }
    ggml_backend_sched_t sched = ctx->get_sched();
    std::string lost; // "HOST:PORT,...": a backend is named "RPC<device>[HOST:PORT]"
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); i++) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
        if (!llama_empanel_on_rpc_host(backend, reg) || !failed(backend)) {
            continue;
        }
        const std::string name = ggml_backend_name(backend);
        const size_t open = name.find('[');
        const size_t close = name.rfind(']');
        if (open == std::string::npos || close == std::string::npos || close <= open) {
            return false; // not named as this ggml-rpc names its backends
        }
        lost += (lost.empty() ? "" : ",") + name.substr(open + 1, close - open - 1);
    }
    if (lost.empty() || !llama_empanel_program_hosts_back(lost)) {
        return false;
    }
    LLAMA_LOG_WARN("empanel: RPC server %s answers again: loading the model anew on it\n", lost.c_str());
    return true;
}
