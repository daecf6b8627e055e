// empanel hooks, RPC hosts: after a decode, whether an RPC host that one of the context's backends
// runs on was lost or timed out during it (ggml-rpc, patches 0008 and 0010)

#include "llama-empanel.h"
#include "llama-empanel-impl.h"

#include "ggml-backend.h"

typedef bool (*llama_empanel_rpc_backend_failed_fn)(ggml_backend_t backend);

bool llama_empanel_hosts_ok(ggml_backend_sched_t sched) {
    // called after every decode: looked up once (ggml registers its built-in backends at start;
    // RPC servers add devices to the RPC registry, not registries of their own to look for)
    static const ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    static const auto failed = reg == nullptr ? nullptr :
        (llama_empanel_rpc_backend_failed_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_backend_failed");
    if (failed == nullptr) {
        return true;
    }
    bool synced = false;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); i++) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
        ggml_backend_dev_t dev = ggml_backend_get_device(backend);
        if (dev == nullptr || ggml_backend_dev_backend_reg(dev) != reg) {
            continue; // not on an RPC host
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