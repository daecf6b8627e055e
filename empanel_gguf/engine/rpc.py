"""llama.cpp's RPC backend: layers (and their slot pools) on other hosts' ggml-rpc-server.

    from empanel_gguf import Llama
    llm = Llama("model.gguf", rpc_servers="10.0.0.2:50052,10.0.0.3:50052", moe_slots="25%")

`add_servers` registers the servers' devices before a load, as llama.cpp's --rpc does; llama.cpp
then places the offloaded layers (n_gpu_layers) on them, in proportion to their free memory, and
each such layer's pools live on its host. A miss writes the expert into the remote pool: by hash
when the host's cache (ggml-rpc-server -c) has seen it, else its bytes (csrc/rpc.c). The design
and its measurements: docs/rpc.md.
"""

from .native import native


class RpcError(RuntimeError):
    """An RPC server cannot be used (unreachable, no devices, a build without RPC), or one was lost
    during a decode (nothing of that decode was returned)."""


def supported():
    """True if this build has ggml's RPC backend."""
    return bool(native().sidecar.empanel_rpc_supported())


def parse_servers(servers):
    """"HOST:PORT,HOST:PORT" (or a list of them) -> a list of endpoints; ValueError if malformed."""
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    endpoints = [item.strip() for item in items if item.strip()]
    if not endpoints:
        raise ValueError(f"rpc_servers={servers!r}: expected HOST:PORT,...")
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"rpc_servers: {endpoint!r} is not HOST:PORT")
    return endpoints


def add_servers(servers):
    """Register the devices of the RPC servers (see parse_servers) for the loads that follow;
    each is tried first. Returns the endpoints; RpcError if one cannot be used."""
    endpoints = parse_servers(servers)
    n = native()
    err = n.ffi.new("char[512]")
    if n.sidecar.empanel_rpc_add_servers(",".join(endpoints).encode(), err, len(err)) < 0:
        raise RpcError(n.ffi.string(err).decode(errors="replace"))
    return endpoints


def check_servers():
    """Every RPC server registered in this process is usable (llama.cpp offers each one's devices
    to every load, and ggml-rpc aborts a process that cannot connect): RpcError naming one that
    is not."""
    n = native()
    if not n.sidecar.empanel_rpc_supported():
        return
    err = n.ffi.new("char[1024]")
    if n.sidecar.empanel_rpc_check_servers(err, len(err)) != 0:
        raise RpcError(n.ffi.string(err).decode(errors="replace"))


def lost_servers():
    """The registered RPC servers whose connection failed in this process (the host died, or a
    wait for it passed EMPANEL_RPC_WAIT_TIMEOUT seconds): a list of endpoints."""
    n = native()
    out = n.ffi.new("char[4096]")
    if n.sidecar.empanel_rpc_lost(out, len(out)) <= 0:
        return []
    return n.ffi.string(out).decode(errors="replace").split(",")


def lost_error(endpoints):
    """The RpcError of a decode that needed lost servers."""
    return RpcError(f"RPC server {', '.join(endpoints)}: the connection was lost or a wait timed out during this "
                    "decode; nothing of it was returned. Once the host serves again, the next call loads the "
                    "model on it anew, its KV cache empty (EMPANEL_RPC_WAIT_TIMEOUT: seconds a wait may take, "
                    "default 600)")


def hosts_back(endpoints):
    """True when every one of the lost endpoints answers a handshake again, so that the model can be
    loaded on them anew (a restarted ggml-rpc-server holds nothing of the old connection). Probes
    at most once a second (False in between), each step waiting 1 s at most."""
    return native().sidecar.empanel_rpc_hosts_back(",".join(endpoints).encode()) == 1


def use_servers(servers, llama_kwargs):
    """Every face's RPC step, before planning (the estimate sees the devices): register the
    servers (add_servers) and offload every layer to them unless llama_kwargs names
    n_gpu_layers. Returns the endpoints, None without servers. Without servers, the servers an
    earlier load registered must still be usable (check_servers)."""
    if not servers:
        check_servers()
        return None
    endpoints = add_servers(servers)
    if llama_kwargs.get("n_gpu_layers") is None:
        llama_kwargs["n_gpu_layers"] = -1
    return endpoints


def wire_counts():
    """(sent, received, round_trips): bytes this process put on and took off the wire to RPC
    servers, and the commands it waited for an answer to (each costs the network's latency)."""
    n = native()
    out = n.ffi.new("uint64_t[3]")
    n.sidecar.empanel_rpc_wire_bytes(out, out + 1, out + 2)
    return int(out[0]), int(out[1]), int(out[2])


# ggml-rpc's commands (enum rpc_cmd of the pinned llama.cpp, in order; RPC_CMD_HELLO is 14)
RPC_COMMANDS = ("alloc_buffer", "get_alignment", "get_max_size", "buffer_get_base", "free_buffer", "buffer_clear",
                "set_tensor", "set_tensor_hash", "get_tensor", "copy_tensor", "graph_compute", "get_device_memory",
                "init_tensor", "get_alloc_size", "hello", "device_count", "graph_recompute", "memset_tensor", "none")


def round_trips_by_command():
    """{command: round trips so far} of the commands this process waited for an answer to; {}
    without RPC. Commands the pinned names do not cover are cmd<N>."""
    n = native()
    out = n.ffi.new("uint64_t[64]")
    count = int(n.sidecar.empanel_rpc_round_trips_by_command(out, 64))
    names = RPC_COMMANDS if count == len(RPC_COMMANDS) else ()
    return {names[i] if names else f"cmd{i}": int(out[i]) for i in range(min(count, 64)) if out[i]}


def offload_devices():
    """Devices llama.cpp can offload layers to: GPUs, and registered RPC servers' devices."""
    return int(native().sidecar.empanel_offload_devices())


def rpc_devices():
    """Of those, the devices of registered RPC servers."""
    return int(native().sidecar.empanel_rpc_devices())


def unified_devices():
    """Of those, the ones that share host memory: integrated GPUs as ggml marks them, Metal."""
    return int(native().sidecar.empanel_unified_devices())
