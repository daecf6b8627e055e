"""Slot pools on llama.cpp's RPC backend: two ggml-rpc-server processes on 127.0.0.1.

The layers llama.cpp places on the servers have their pools there; a miss writes the expert over
the wire, by hash once the server's cache (-c) holds it (csrc/rpc.c, patch 0008). Exact: the same
logits as the same placement without slots. Every load runs in a child process: the devices of
RPC servers stay registered in a process, for every later load. A host lost mid-run fails the
decodes that need it (patches 0008 and 0010), in Python and in llama-server.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import child_env, free_port, require_programs, stop_process

REPO = Path(__file__).resolve().parent.parent


def _rpc_server_path():
    from empanel_gguf.commands.programs import programs_dir

    return programs_dir() / "ggml-rpc-server"


def _supported():
    from empanel_gguf.engine import rpc

    return rpc.supported() and _rpc_server_path().is_file()


pytestmark = pytest.mark.skipif(not _supported(), reason="this build has no RPC backend (-DGGML_RPC=OFF)")


def _wait_listening(proc, port, log, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"ggml-rpc-server exited with {proc.returncode}:\n{Path(log).read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"ggml-rpc-server did not listen on {port}:\n{Path(log).read_text()[-2000:]}")
            time.sleep(0.1)


class RpcServers:
    """ggml-rpc-server processes on loopback (through `empanel-gguf rpc-server`), each with a
    cache folder of its own (cache=True) or none."""

    def __init__(self, tmp, caches):
        Path(tmp).mkdir(parents=True, exist_ok=True)
        self.caches = caches
        self.procs, self.endpoints, self.cache_dirs, self.logs = [], [], [], []
        for i in range(len(caches)):
            self.endpoints.append(f"127.0.0.1:{free_port()}")
            self.cache_dirs.append(Path(tmp) / f"cache{i}")
            self.logs.append(Path(tmp) / f"rpc{i}.log")
            self.procs.append(self._start(i))
        for proc, endpoint, log in zip(self.procs, self.endpoints, self.logs):
            _wait_listening(proc, int(endpoint.rsplit(":", 1)[1]), log)

    def _start(self, i):
        port = self.endpoints[i].rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "empanel_gguf", "rpc-server", "-H", "127.0.0.1", "-p", port, "-t", "1"]
        if self.caches[i]:
            cmd.append("-c")
        with open(self.logs[i], "a") as out:
            return subprocess.Popen(cmd, cwd=REPO, env=child_env(LLAMA_CACHE=str(self.cache_dirs[i])), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def restart(self, i):
        """Server i again, on its port and with its cache folder (after it was killed)."""
        self.procs[i] = self._start(i)
        _wait_listening(self.procs[i], int(self.endpoints[i].rsplit(":", 1)[1]), self.logs[i])

    @property
    def servers(self):
        return ",".join(self.endpoints)

    def cached_files(self, i):
        return sorted(p for p in self.cache_dirs[i].rglob("*") if p.is_file())

    def stop(self):
        for proc in self.procs:
            stop_process(proc, group=True)


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    servers = RpcServers(tmp_path_factory.mktemp("rpc"), caches=(True, True))
    yield servers
    servers.stop()


# one child: the same split without slots, then with slots two passes over the same prompt
CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from empanel_gguf import Llama
    from empanel_gguf.models import fixtures
    from empanel_gguf.engine import rpc
    from empanel_gguf.commands.options import default_model_path
    from empanel_gguf.lab.exactness import greedy_logits

    model, servers, slots, out = sys.argv[1:5]
    path = str(default_model_path()) if model == "builtin" else str(fixtures.write_fixture(model, sys.argv[5]))
    text = b"Once upon a time, in a land far away, there lived a king who had three daughters."
    kw = dict(n_ctx=256, logits_all=True, verbose=False, rpc_servers=servers, n_threads=1)

    def decode_trips(llm):  # round trips per decoded token, after the text
        llm.reset()
        llm.eval(llm.tokenize(text))
        r0 = rpc.wire_counts()[2]
        for token in ref_tokens[:4]:
            llm.eval([token])
        return (rpc.wire_counts()[2] - r0) / 4

    llm = Llama(path, **kw)
    ref, ref_tokens = greedy_logits(llm, text, 6)
    stock_trips = decode_trips(llm)
    llm.close()

    llm = Llama(path, moe_slots=slots, moe_io_threads=2, **kw)
    passes = []
    for _ in range(2):
        w0, c0 = rpc.wire_counts(), rpc.round_trips_by_command()
        s0 = llm.moe_stats()["total"]
        llm.reset()
        logits, tokens = greedy_logits(llm, text, 6)
        s1 = llm.moe_stats()["total"]
        w1, c1 = rpc.wire_counts(), rpc.round_trips_by_command()
        passes.append({"equal": bool(np.array_equal(logits, ref)) and tokens == ref_tokens,
                       "max_diff": float(np.abs(logits - ref).max()),
                       **{k: s1[k] - s0[k] for k in ("misses", "hits", "bytes_read", "copy_bytes", "remote_by_hash",
                                                       "n_waves", "n_remaps", "device_syncs")},
                       "wire_sent": w1[0] - w0[0], "round_trips": w1[2] - w0[2],
                       "by_command": {k: v - c0.get(k, 0) for k, v in c1.items() if v - c0.get(k, 0)}})
    n_tensors = {len(layer.tensors) for layer in llm._experts.index.layers}
    trips = {"stock": stock_trips, "pools": decode_trips(llm), "moe_layers": len(llm._experts.index.layers)}
    llm.close()
    json.dump({"passes": passes, "n_tensors": sorted(n_tensors), "trips": trips}, open(out, "w"))
""")


def _run_child(tmp_path, model, servers, slots="25%"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / f"{model}.json"
    proc = subprocess.run([sys.executable, "-c", CHILD, model, servers, slots, str(out), str(tmp_path / "models")],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("model", ["builtin", "mixtral", "qwen3moe-q4_k"])
def test_split_over_two_servers_bit_identical_and_second_pass_by_hash(tmp_path, two_servers, model):
    """25 % slots on layers split over two servers give the logits of the same split without
    slots, in both passes; the second pass over the same prompt reads nothing and sends no expert:
    each miss is one hash the server's cache answers (counted per expert tensor)."""
    result = _run_child(tmp_path, model, two_servers.servers)
    first, second = result["passes"]
    for p in (first, second):
        assert p["equal"], p
    assert first["misses"] > 0 and first["bytes_read"] > 0
    assert first["copy_bytes"] > 0  # the first time, the experts' bytes go over the wire
    assert second["misses"] > 0, second  # 25 %: the pools evicted the first pass's experts
    assert second["bytes_read"] == 0 and second["copy_bytes"] == 0, second
    assert second["remote_by_hash"] == second["misses"] * result["n_tensors"][0], second
    # both passes send the same graphs and activations; the second one none of the experts
    assert first["wire_sent"] - second["wire_sent"] >= 0.95 * first["copy_bytes"], (first, second)
    # a batch's writes by hash go back to back: one round trip per batch and host, not one per
    # expert tensor (stock servers answer them in order as they read them)
    n_tensors, = result["n_tensors"]
    by_hash_trips = second["by_command"]["set_tensor_hash"]
    assert 0 < by_hash_trips <= second["n_waves"] * n_tensors and by_hash_trips < second["remote_by_hash"], second
    for p in (first, second):  # by command they add up: the routed ids read back (get_tensor), writes by hash
        assert sum(p["by_command"].values()) == p["round_trips"] and "get_tensor" in p["by_command"], p
    # decoding, a MoE layer costs at most two round trips more than stock's: its routed ids read
    # back, and one batch of writes by hash (moe_guess auto: no guess read back from a host)
    trips = result["trips"]
    assert trips["pools"] <= trips["stock"] + 2 * trips["moe_layers"], trips
    assert first["n_waves"] > first["n_remaps"], first  # the prompt ran in waves over the remote pools
    # every remap (and guess) of a layer on a host waits for it: counted as device syncs
    assert first["device_syncs"] >= first["n_remaps"] > 0, first
    for i in range(2):  # both servers hold pools: each kept experts in its cache
        assert two_servers.cached_files(i), f"server {i} cached nothing"


def test_first_offers_by_hash_go_together(tmp_path):
    """A new process on hosts whose caches hold the experts (an earlier client sent them): its
    misses' hashes are not known before they are read, so each read expert is offered by hash as
    it lands. The offers of a batch go back to back, one round trip per batch and host (63-11:
    they went one per expert and tensor), and no expert's bytes cross the wire."""
    servers = RpcServers(tmp_path / "srv", caches=(True, True))
    try:
        _run_child(tmp_path / "fill", "builtin", servers.servers)  # the hosts' caches fill
        first, _ = _run_child(tmp_path / "again", "builtin", servers.servers)["passes"]
    finally:
        servers.stop()
    assert first["equal"] and first["misses"] > 0 and first["bytes_read"] > 0, first
    assert first["copy_bytes"] == 0, first  # every read expert was held by its host
    # per wave one ask for the hashes known before the reads (experts read earlier in this process)
    # and one per group of reads that fits the staging (mostly one): 108 here, 367 before
    trips = first["by_command"]["set_tensor_hash"]
    assert first["remote_by_hash"] > 3 * trips and trips <= 3 * first["n_waves"], first


def test_hosts_back_answers_every_caller_within_its_second(two_servers):
    """Two models asking within one second whether their lost hosts answer again both hear it
    (63-15: the probe ran once a second for the whole process, and the second caller got 0, which
    Llama raises as RpcError); a host that is not there is not back."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        from empanel_gguf.engine.rpc import hosts_back
        endpoints = sys.argv[1].split(",")
        print(hosts_back(endpoints), hosts_back(endpoints), hosts_back(endpoints[:1]), hosts_back(["127.0.0.1:9"]))
        """), two_servers.servers], env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["True", "True", "True", "False"], result.stdout + result.stderr[-2000:]


def test_server_without_cache_gets_bytes(tmp_path):
    """A server started without -c keeps nothing: the hash it is asked for is refused, the pools
    on it go back to sending bytes, and the logits are still exact."""
    servers = RpcServers(tmp_path / "srv", caches=(False,))
    try:
        result = _run_child(tmp_path, "builtin", servers.servers)
    finally:
        servers.stop()
    first, second = result["passes"]
    for p in (first, second):
        assert p["equal"], p
    assert second["misses"] > 0 and second["copy_bytes"] > 0 and second["bytes_read"] > 0, second
    assert second["remote_by_hash"] == 0, second


def test_unreachable_server_is_an_error_not_an_abort(tmp_path):
    """ggml-rpc aborts the process when it cannot connect: the server is tried first."""
    port = free_port()  # nobody listens there
    code = textwrap.dedent(f"""
        from empanel_gguf import Llama
        from empanel_gguf.engine import rpc
        from empanel_gguf.commands.options import default_model_path
        try:
            Llama(str(default_model_path()), rpc_servers="127.0.0.1:{port}", verbose=False)
        except rpc.RpcError as e:
            print("RpcError:", e)
        try:
            rpc.add_servers("localhost")
        except ValueError as e:
            print("ValueError:", e)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"RpcError: RPC server 127.0.0.1:{port}: cannot connect" in proc.stdout, proc.stdout
    assert "ValueError: rpc_servers: 'localhost' is not HOST:PORT" in proc.stdout, proc.stdout


def test_run_command_with_rpc(tmp_path, two_servers):
    """`empanel-gguf run --rpc` completes on the built-in model with its layers on the servers,
    the same text as without slots on the same servers."""
    def run(slots):
        proc = subprocess.run([sys.executable, "-m", "empanel_gguf", "run", "-n", "12", "--temp", "0", "-t", "1",
                               "--rpc", two_servers.servers, "-ms", slots],
                              cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc
    paged, stock = run("25%"), run("none")
    assert paged.stdout == stock.stdout and len(paged.stdout.strip()) > 0
    assert "misses" in paged.stderr


def test_llama_perplexity_with_rpc_equal_to_stock(tmp_path, two_servers):
    """llama.cpp's own --rpc: llama-perplexity over the two servers with slot pools prints every
    chunk's value and the final estimate of the same split without them."""
    require_programs("llama-perplexity")
    from empanel_gguf.commands.options import default_model_path
    from empanel_gguf.planning.profile import DEFAULT_TEXT

    text = tmp_path / "text.txt"
    text.write_text(DEFAULT_TEXT * 2)

    def ppl(slots):
        proc = subprocess.run([sys.executable, "-m", "empanel_gguf", "llama-perplexity", "--moe-slots", slots,
                               "-m", str(default_model_path()), "-f", str(text), "-c", "128", "-b", "128",
                               "--chunks", "3", "-t", "1", "--rpc", two_servers.servers, "-ngl", "99"],
                              cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout + proc.stderr
        chunks = re.findall(r"\[\d+\]\d+\.\d+", out)
        final = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
        assert chunks and final, out[-3000:]
        return chunks, final.group(1), proc.stderr
    paged, stock = ppl("25%"), ppl("none")
    assert paged[:2] == stock[:2]
    assert "misses" in paged[2]


def test_serve_with_rpc(tmp_path, two_servers):
    """`empanel-gguf serve --rpc`: llama_cpp.server's completions with the layers and their pools
    on the servers, the same text as the same split without slots; the stats show the wire."""
    pytest.importorskip("uvicorn", reason='llama_cpp.server extras missing: pip install "empanel-gguf[server]"')
    from conftest import wait_until_serving

    def complete(slots):
        port = free_port()
        log = tmp_path / f"serve-{slots.strip('%')}.log"
        cmd = [sys.executable, "-m", "empanel_gguf", "serve", "--moe-slots", slots, "--rpc", two_servers.servers,
               "--n_ctx", "256", "--n_threads", "1", "--host", "127.0.0.1", "--port", str(port)]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(drop=("MODEL", "CONFIG_FILE", "HOST", "PORT")),
                                    stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_serving(proc, f"{base}/v1/models", log, 60)
            body = json.dumps({"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0}).encode()
            request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                text = json.loads(response.read())["choices"][0]["text"]
            with urllib.request.urlopen(f"{base}/v1/empanel/stats", timeout=10) as response:
                stats = json.loads(response.read())
            return text, stats
        finally:
            stop_process(proc)

    paged, stats = complete("25%")
    stock, _ = complete("none")
    assert paged == stock and len(paged) > 0
    assert stats["total"]["misses"] > 0 and stats["total"]["wire_sent"] > 0, stats["total"]


def test_exec_with_rpc(tmp_path, two_servers):
    """`empanel-gguf exec --rpc`: an unchanged llama-cpp-python program's Llama gets the servers."""
    program = tmp_path / "app.py"
    program.write_text(textwrap.dedent("""
        import llama_cpp, sys
        llm = llama_cpp.Llama(sys.argv[1], n_ctx=128, n_threads=1, verbose=False)
        out = llm("ROMEO:", max_tokens=6, temperature=0)["choices"][0]["text"]
        stats = llm.moe_stats()["total"]
        print(repr(out), llm.rpc_servers, stats["misses"] > 0, stats["wire_sent"] > 0)
    """))
    from empanel_gguf.commands.options import default_model_path

    proc = subprocess.run([sys.executable, "-m", "empanel_gguf", "exec", "--moe-slots", "25%", "--rpc",
                           two_servers.servers, "--", sys.executable, str(program), str(default_model_path())],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith(f"{two_servers.endpoints} True True"), proc.stdout


def _listener():
    """A socket listening on a free loopback port (its port: getsockname()[1])."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    return sock


def _add_servers_in_child(tmp_path, servers, then=None, **env):
    """rpc.add_servers(servers) in a fresh process (then add_servers(then), where given): its
    stdout, which says the RpcError, "devices: N" after the list and "then: N" after `then`."""
    code = textwrap.dedent(f"""
        from empanel_gguf.engine import rpc
        try:
            rpc.add_servers({servers!r})
        except rpc.RpcError as e:
            print("RpcError:", e)
        print("devices:", rpc.offload_devices())
        if {then!r} is not None:
            rpc.add_servers({then!r})
            print("then:", rpc.offload_devices())
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(**env), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_busy_or_mute_server_is_an_error_not_a_hang(tmp_path):
    """A server that accepts but never answers the handshake (one busy with another client
    looks so) is an RpcError after EMPANEL_RPC_TIMEOUT seconds, and nothing of the list stays
    registered."""
    mute = _listener()
    try:
        out = _add_servers_in_child(tmp_path, f"127.0.0.1:{mute.getsockname()[1]}", EMPANEL_RPC_TIMEOUT="1")
    finally:
        mute.close()
    assert "no answer to the handshake in 1.0 s" in out, out
    assert "devices: 0" in out


def _no_device_host(listener, stop):
    """A host that shakes hands as a ggml-rpc-server does (HELLO: | cmd 14 | size (8 bytes) |
    caps | -> | size | major 7, minor 0, patch 0, pad, caps |) and then offers no device
    (DEVICE_COUNT, cmd 15: 0): the probe passes, ggml's add_server fails after it."""
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        with conn:
            try:
                while True:
                    head = conn.recv(9, socket.MSG_WAITALL)
                    if len(head) < 9:
                        break
                    size = int.from_bytes(head[1:], "little")
                    caps = conn.recv(size, socket.MSG_WAITALL) if size else b""
                    answer = bytes([7, 0, 0, 0]) + caps if head[0] == 14 else (0).to_bytes(4, "little")
                    conn.sendall(len(answer).to_bytes(8, "little") + answer)
            except OSError:
                pass


def test_a_list_that_fails_after_its_probe_leaves_nothing_registered(tmp_path, two_servers):
    """63-14: a host that answers the handshake but offers no device fails the list in ggml's
    add_server, after the probe; the good host listed before it is not left registered (it was:
    each endpoint was registered as it was added), and the same good host alone registers after."""
    import threading

    listener = _listener()
    stop = threading.Event()
    host = threading.Thread(target=_no_device_host, args=(listener, stop), daemon=True)
    host.start()
    good = two_servers.servers.split(",")[0]
    try:
        out = _add_servers_in_child(tmp_path, f"{good},127.0.0.1:{listener.getsockname()[1]}", then=good)
    finally:
        stop.set()
        host.join()
        listener.close()
    assert "offers no devices" in out, out
    assert "devices: 0" in out and "then: 1" in out, out


# a host lost while the client decodes: the decode fails (RpcError), the client goes on
LOST_CHILD = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    import numpy as np
    from empanel_gguf import Llama
    from empanel_gguf.engine import rpc
    from empanel_gguf.commands.options import default_model_path
    from empanel_gguf.lab.exactness import greedy_logits

    servers, victim_group, port, cache_dir, how, out = sys.argv[1:7]
    path = str(default_model_path())
    text = b"Once upon a time, in a land far away"
    kw = dict(n_ctx=512, logits_all=True, verbose=False, rpc_servers=servers, n_threads=1)
    result = {}

    llm = Llama(path, **kw)  # the reference: the same placement, without slots
    ref, ref_tokens = greedy_logits(llm, text, 4)
    llm.close()

    llm = Llama(path, moe_slots="25%", **kw)
    t0 = time.monotonic()
    n = 0
    try:
        for n, _ in enumerate(llm.create_completion("ROMEO:", max_tokens=200, temperature=0.0, stream=True)):
            if n == 5:  # the host goes while this client decodes
                os.killpg(int(victim_group), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        result["caught"] = None
    except rpc.RpcError as e:
        result["caught"] = str(e)
    result["seconds"] = time.monotonic() - t0
    result["tokens"] = n

    try:  # the host is still down: the same Llama says so again, it does not abort
        greedy_logits(llm, text, 4)
        result["again"] = None
    except rpc.RpcError as e:
        result["again"] = str(e)
    try:  # and so does a new load, while this one is open
        Llama(path, moe_slots="25%", **kw)
        result["down"] = None
    except rpc.RpcError as e:
        result["down"] = str(e)

    if how == "stop":  # the host runs again: it drops the old connection, which the client closed
        os.killpg(int(victim_group), signal.SIGCONT)
    else:  # a new server on the same port and cache
        env = dict(os.environ, LLAMA_CACHE=cache_dir)
        server = subprocess.Popen([sys.executable, "-m", "empanel_gguf", "rpc-server", "-H", "127.0.0.1", "-p", port,
                                   "-t", "1", "-c"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        result["restarted"] = server.pid
    json.dump(result, open(out, "w"))  # the parent stops it even if what follows fails
    deadline = time.monotonic() + 60
    while True:  # the same Llama loads anew once the host answers: exact again
        try:
            logits, tokens = greedy_logits(llm, text, 4)
            break
        except rpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    result["equal"] = bool(np.array_equal(logits, ref)) and tokens == ref_tokens
    result["reloads"] = llm.moe_stats()["total"]["rpc_reloads"]
    llm.close()
    result["closed"] = True
    json.dump(result, open(out, "w"))
""")


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_host_lost_during_a_decode_is_an_error_not_an_abort(tmp_path, how):
    """A host killed (or stopped: its waits time out, EMPANEL_RPC_WAIT_TIMEOUT) while the client
    decodes: the decode raises RpcError and returns nothing; while the host is down the same Llama
    raises it again and a new load is an RpcError naming it; once the host serves again (restarted,
    or running again) the same Llama loads anew on it by itself and gives the reference logits."""
    servers = RpcServers(tmp_path / "srv", caches=(True, True))
    out = tmp_path / "lost.json"
    result = {}
    try:
        port = servers.endpoints[1].rsplit(":", 1)[1]
        proc = subprocess.run([sys.executable, "-c", LOST_CHILD, servers.servers, str(servers.procs[1].pid), port,
                               str(servers.cache_dirs[1]), how, str(out)],
                              cwd=tmp_path, env=child_env(EMPANEL_RPC_WAIT_TIMEOUT="3"), capture_output=True,
                              text=True, timeout=300)
        result = json.loads(out.read_text()) if out.exists() else {}
    finally:
        servers.stop()
        if result.get("restarted"):
            try:
                os.killpg(result["restarted"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 0, proc.stderr[-3000:]  # no signal, no abort
    assert result["caught"] and f"RPC server {servers.endpoints[1]}" in result["caught"], result
    assert result["tokens"] < 199 and result["seconds"] < 60, result  # failed early, never hung
    assert result["again"] and f"RPC server {servers.endpoints[1]}" in result["again"], result
    assert result["down"] and servers.endpoints[1] in result["down"] and "earlier run" in result["down"], result
    assert result["equal"] and result["reloads"] == 1, result
    assert result["closed"]


def _cutting_link(listener, host, arm, stop, cut, refuse=()):
    """A link to `host` (its port) that forwards both ways and, once the file `arm` exists, cuts
    the connection (both sockets) where the client's second SET_TENSOR_HASH (cmd 7) of a batch
    would pass: inside one batch of writes by hash, the first of them sent. Client frames are
    | cmd (1 byte) | size (8 bytes) | payload |; cut is set once it cut. After the cut, the
    connections numbered in `refuse` (from 1) are closed at once: the load anew makes two probes
    (1: the one that finds the host back, 2: the load's own), then ggml-rpc's connections (3, 4
    and 5: the tries of the first)."""
    import threading

    def shut(*socks):
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def pump(src, dst):
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        shut(src, dst)

    def client_to_host(conn, upstream):
        seen = 0
        try:
            while head := conn.recv(9, socket.MSG_WAITALL):
                size = int.from_bytes(head[1:], "little")
                payload = conn.recv(size, socket.MSG_WAITALL) if size else b""
                if head[0] == 7 and not cut.is_set() and os.path.exists(arm):
                    seen += 1
                    if seen == 2:
                        cut.set()
                        break
                upstream.sendall(head + payload)
        except OSError:
            pass
        shut(conn, upstream)

    listener.settimeout(0.2)
    after_cut = 0
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        after_cut += cut.is_set()
        if after_cut in refuse:
            conn.close()
            continue
        upstream = socket.create_connection(("127.0.0.1", host))
        for sock in (conn, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=client_to_host, args=(conn, upstream), daemon=True).start()
        threading.Thread(target=pump, args=(upstream, conn), daemon=True).start()


CUT_CHILD = textwrap.dedent("""
    import json, sys, time
    from empanel_gguf import Llama
    from empanel_gguf.engine import rpc
    from empanel_gguf.commands.options import default_model_path
    from empanel_gguf.lab.exactness import greedy_logits

    servers, arm, out, verbose = sys.argv[1:5]
    path = str(default_model_path())
    text = b"Once upon a time, in a land far away"
    kw = dict(n_ctx=512, logits_all=True, verbose=verbose == "1", rpc_servers=servers, n_threads=1)
    llm = Llama(path, **kw)  # the reference: the same placement, without slots
    ref, ref_tokens = greedy_logits(llm, text, 4)
    llm.close()
    llm = Llama(path, moe_slots="25%", **kw)
    greedy_logits(llm, text, 4)  # the experts' bytes sent with the cache flag: later misses by hash
    llm.reset()
    result = {"by_hash_before": llm.moe_stats()["total"]["remote_by_hash"]}
    open(arm, "w").close()  # the link cuts inside the next batch of writes by hash
    try:
        for n, _ in enumerate(llm.create_completion("ROMEO:", max_tokens=100, temperature=0.0, stream=True)):
            pass
        result["caught"] = None
    except rpc.RpcError as e:
        result["caught"] = str(e)
    deadline = time.monotonic() + 60
    result["failed_loads"] = 0
    while True:  # the link passes again: the same Llama loads anew on the host, exact again
        try:
            llm.reset()
            logits, tokens = greedy_logits(llm, text, 4)
            break
        except rpc.RpcError as e:
            result["failed_loads"] += "was lost or a wait" not in str(e)  # the load anew failed (not: not back yet)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    stats = llm.moe_stats()["total"]
    result.update(equal=bool((logits == ref).all()) and tokens == ref_tokens, reloads=stats["rpc_reloads"],
                  by_hash_after=stats["remote_by_hash"], copy_bytes=stats["copy_bytes"])
    llm.close()
    json.dump(result, open(out, "w"))
""")


@pytest.mark.parametrize("refuse", [(), (2,), (3, 4, 5)], ids=["cut", "probe-refused", "connect-refused"])
def test_a_host_cut_inside_a_batch_by_hash_fails_the_token_and_comes_back(tmp_path, refuse):
    """63-10 and 63-13: the connection to a host cut inside one batch of writes by hash (a link
    that drops it at the batch's second write). Those writes are not answered (patch 0008: 2, not
    "not held"), so the host's cache is not taken for gone and no bytes count as sent: the token
    fails with RpcError naming the host, the same Llama loads anew once the link passes again,
    gives the reference logits, and its misses go by hash again, the cache kept. probe-refused:
    the load anew fails at its own probe after the host was found back; the Llama must not reach
    the freed model (a segmentation fault in tokenize) but raise RpcError and load at a later
    call. connect-refused: the host refuses ggml-rpc's first connection at each of its three
    tries (ggml-rpc aborted the process there): that connection fails, nothing aborts, and the
    Llama comes back as before."""
    import threading

    servers = RpcServers(tmp_path / "srv", caches=(True,))
    listener = _listener()
    stop, cut = threading.Event(), threading.Event()
    arm = tmp_path / "arm"
    link = threading.Thread(target=_cutting_link, args=(listener, int(servers.endpoints[0].rsplit(":", 1)[1]),
                                                        str(arm), stop, cut, refuse), daemon=True)
    link.start()
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    out = tmp_path / "cut.json"
    try:
        proc = subprocess.run([sys.executable, "-c", CUT_CHILD, endpoint, str(arm), str(out), str(int(3 in refuse))],
                              cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    finally:
        stop.set()
        link.join()
        listener.close()
        servers.stop()
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert cut.is_set() and result["by_hash_before"] > 0, result
    assert result["caught"] and f"RPC server {endpoint}" in result["caught"], result
    assert result["equal"] and result["reloads"] == 1, result
    assert result["by_hash_after"] > 0 and result["copy_bytes"] == 0, result  # the host's cache, kept
    if 2 in refuse:  # the failed load anew was an RpcError, and a later call loaded
        assert result["failed_loads"] >= 1, result
    if 3 in refuse:  # ggml-rpc's connection failed (no abort), and the model came back all the same
        assert "no connection or no handshake; what runs there fails" in proc.stderr, proc.stderr[-1500:]


def _reloads(base):
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        found = re.search(r"^empanel_rpc_reloads_total (\S+)$", response.read().decode(), re.M)
    return float(found.group(1)) if found else None


@pytest.mark.parametrize("slots", ["25%", "none"])
def test_llama_server_under_load_takes_a_lost_host_back(tmp_path, slots):
    """`empanel-gguf llama-server --rpc` at 25 % slots (and stock, without) under the load of
    test_programs.py::test_llama_server_under_load, one host killed after 40 answers, then started
    again: every request is answered (200 before the loss; after it llama-server's own 500
    "Compute error.", or an error event in a stream already under way), nothing aborts; once the
    host serves again the server loads the model on it anew by itself (patch 0014) and answers as
    stock llama.cpp on the same hosts does; it ends on SIGTERM with an exit status, never a signal."""
    import loadgen
    from empanel_gguf.commands.options import default_model_path

    require_programs("llama-server")
    model = str(default_model_path())
    prompts = ["ROMEO:", "JULIET:", "Once upon a time"]
    ask_all = lambda base: [loadgen.ask(base, p, chat=False, stream=False) for p in prompts]  # noqa: E731
    servers = RpcServers(tmp_path / "srv", caches=(True, True))
    try:
        with loadgen.llama_server(model, "none", tmp_path / "stock.log", "--rpc", servers.servers) as (base, _):
            stock = ask_all(base)
        victim = servers.procs[1]
        with loadgen.llama_server(model, slots, tmp_path / "server.log", "--rpc", servers.servers) as (base, proc):
            before = ask_all(base)
            load = loadgen.run_load(base, after=(40, lambda: os.killpg(victim.pid, signal.SIGKILL)))
            during = loadgen.ask(base, "ROMEO:", chat=False, stream=False)
            servers.restart(1)
            deadline, refused_after = time.monotonic() + 60, 0
            while (answer := loadgen.ask(base, "ROMEO:", chat=False, stream=False))["status"] != 200:
                refused_after += 1
                assert time.monotonic() < deadline, answer
                time.sleep(0.2)
            after = ask_all(base)
            reloads = _reloads(base)
            with urllib.request.urlopen(f"{base}/health", timeout=10) as response:
                health = response.status
            alive = proc.poll() is None
    finally:
        servers.stop()
    answers = load["answers"]
    assert len(answers) == 124
    unanswered = [a for a in answers if a["status"] is None]
    assert not unanswered, unanswered[:4]  # no reset, no hang: every request has its answer
    served = [a for a in answers if a["status"] == 200 and not a["error"] and a["text"]]
    refused = [a for a in answers if a not in served]
    assert len(served) >= 30, len(served)  # those before the loss
    assert refused and all("Compute error" in (a["error"] or "") for a in refused), refused[:4]
    assert all(400 <= status < 500 for status, _ in load["malformed"]), load["malformed"]
    assert during["status"] == 500 and "Compute error" in during["error"]
    texts = lambda answers: [a["text"] for a in answers]  # noqa: E731
    assert all(a["status"] == 200 for a in stock + before + after), stock + before + after
    assert texts(before) == texts(stock) and texts(after) == texts(stock), (stock, before, after)
    assert reloads == 1, reloads
    assert alive and health == 200
    assert proc.returncode is not None and proc.returncode >= 0, proc.returncode  # not a signal
    log = (tmp_path / "server.log").read_text()
    assert f"RPC server {servers.endpoints[1]}: the connection was lost" in log, log[-3000:]
    assert f"empanel: RPC server {servers.endpoints[1]} answers again" in log, log[-3000:]


def _cut_short(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _same_size_damage(path):
    """64 bytes in the middle changed, the size kept (a bad sector, a disk tool, a second writer)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0x5A for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_cut_short, _same_size_damage], ids=["short", "same-size"])
def test_damaged_cache_file_is_not_used(tmp_path, damage):
    """A host's cache file that does not hold the bytes of its name (cut short, or changed with its
    size kept) is refused, on every host: the expert's bytes are sent again and cached anew, and
    the logits stay exact."""
    servers = RpcServers(tmp_path / "srv", caches=(True, True))
    try:
        first = _run_child(tmp_path / "a", "builtin", servers.servers)
        assert first["passes"][1]["remote_by_hash"] > 0
        files = servers.cached_files(0) + servers.cached_files(1)
        assert servers.cached_files(0) and servers.cached_files(1)
        for path in files:  # every cached expert on both hosts
            damage(path)
        again = _run_child(tmp_path / "b", "builtin", servers.servers)
    finally:
        servers.stop()
    cold, warm = again["passes"]
    assert cold["equal"] and warm["equal"], again
    # the damaged cache counts as empty: every expert is sent again, as on the first run (whose
    # by-hash writes in pass 1 are re-misses of experts sent earlier in the pass)
    fresh = first["passes"][0]
    assert cold["copy_bytes"] == fresh["copy_bytes"] > 0, (cold, fresh)
    assert cold["remote_by_hash"] == fresh["remote_by_hash"], (cold, fresh)
    assert warm["remote_by_hash"] > 0 and warm["copy_bytes"] == 0, warm  # the host saved them anew


def test_rpc_build_keeps_cpu_host_pools_unmasked(tmp_path):
    """Building ggml's RPC backend makes llama_supports_gpu_offload() true, yet no GPU kernel
    can touch host pools: plain host pools of a CPU build still run unmasked waves."""
    code = textwrap.dedent("""
        import sys
        from empanel_gguf import Llama
        from empanel_gguf.models import fixtures
        path = fixtures.write_fixture("qwen3moe-f16", sys.argv[1])
        llm = Llama(str(path), n_ctx=128, verbose=False, moe_slots="25%")
        llm.eval(llm.tokenize(b"Once upon a time, in a land far away"))
        print("masked:", llm.moe_stats()["total"]["masked_pools"])
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "masked: 0" in proc.stdout, proc.stdout


def build_link(tmp_path):
    """scripts/rpc_link.c compiled into tmp_path (skipped without a C compiler)."""
    import shutil

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "rpc_link"
    subprocess.run(["cc", "-O2", "-pthread", str(Path(__file__).parent.parent / "scripts" / "rpc_link.c"), "-o",
                    str(exe)], check=True)
    return exe


def test_link_proxy_delivers_in_order_after_its_delay(tmp_path):
    """scripts/rpc_link.c, the bench's link (bench_rpc.py --links): 4 MiB through a 10 ms round
    trip at 1 Gbit/s arrive intact and in order, no sooner than the link allows; SIGTERM reports
    its CPU time. (Lower bounds only: a busy machine may deliver later, never sooner.)"""
    import threading

    exe = build_link(tmp_path)
    server = socket.create_server(("127.0.0.1", 0))

    def echo():
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    port = free_port()
    proxy = subprocess.Popen([str(exe), str(port), str(server.getsockname()[1]), "5000", "1000", "120"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout.readline().strip() == "listening"
        payload = os.urandom(4 << 20)
        got = bytearray()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            t0 = time.perf_counter()
            conn.sendall(b"x")
            assert conn.recv(1) == b"x"
            assert time.perf_counter() - t0 >= 0.010  # one round trip: 5 ms each way
            def read_back():
                while len(got) < len(payload):
                    got.extend(conn.recv(1 << 20))

            reader = threading.Thread(target=read_back)
            t0 = time.perf_counter()
            reader.start()
            conn.sendall(payload)
            reader.join(timeout=60)
            # 4 MiB each way at 1 Gbit/s: at least 33.5 ms on the wire, plus the round trip
            assert time.perf_counter() - t0 >= 0.010 + len(payload) * 8 / 1e9
        assert bytes(got) == payload
    finally:
        proxy.terminate()
        out = proxy.communicate(timeout=30)[0]
        server.close()
    assert re.search(r"cpu_s \d+\.\d+", out), out


def test_link_proxy_lets_go_when_the_receiver_is_gone(tmp_path):
    """scripts/rpc_link.c: a receiver that closes while the link's queue is full (8 MiB waiting on
    a 1 s delay) ends the connection: its threads end and the sender's socket is closed (63-16:
    the reader waited for room for ever, its threads and sockets leaked)."""
    import threading

    exe = build_link(tmp_path)
    server = socket.create_server(("127.0.0.1", 0))

    def close_at_once():
        conn, _ = server.accept()
        conn.close()

    threading.Thread(target=close_at_once, daemon=True).start()
    port = free_port()
    proxy = subprocess.Popen([str(exe), str(port), str(server.getsockname()[1]), "1000000", "0", "120"],
                             stdout=subprocess.PIPE, text=True)
    flood_error = []
    try:
        assert proxy.stdout.readline().strip() == "listening"
        conn = socket.create_connection(("127.0.0.1", port))

        def flood():  # more than the queue holds, until the proxy lets go of the connection
            try:
                block = os.urandom(1 << 20)
                for _ in range(64):
                    conn.sendall(block)
            except OSError as e:
                flood_error.append(e)

        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        t0 = time.monotonic()
        tasks = lambda: len(os.listdir(f"/proc/{proxy.pid}/task"))  # noqa: E731
        while (tasks() > 1 or sender.is_alive()) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert tasks() == 1, "the proxy's connection threads are still there"  # (its listener alone)
        assert flood_error, "the sender's socket was never closed"
        conn.close()
    finally:
        proxy.terminate()
        proxy.communicate(timeout=30)
        server.close()
