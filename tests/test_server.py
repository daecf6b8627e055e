"""`empanel-gguf serve`: llama_cpp.server with slot pools, over real HTTP on loopback.

One server subprocess on 127.0.0.1 and a free port serves a fixture model; the `openai` client
asks for chat and completions, streaming and not, two at once; at temperature 0 the answers equal
the in-process empanel_gguf.Llama with the same settings. Every wait is bounded and the server is
always killed. Needs llama_cpp.server's extras (`pip install "empanel-gguf[server]"`) and
`openai`; without them these tests are skipped.
"""

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import child_env, free_port, stop_process, wait_until_serving

for _name in ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings"):
    pytest.importorskip(_name, reason='llama_cpp.server extras missing: pip install "empanel-gguf[server]"')
openai = pytest.importorskip("openai", reason="the openai client is missing: pip install openai")

from empanel_gguf import Llama  # noqa: E402
from empanel_gguf.models import fixtures  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL = "qwen3moe-q8_0"
SLOTS = 8
N_CTX = 512
START_TIMEOUT = 45  # seconds for the server to answer
REQUEST_TIMEOUT = 30
# what llama_cpp.server's request models default to, and the in-process calls must repeat
SERVER_DEFAULTS = dict(repeat_penalty=1.1, top_k=40, top_p=0.95, min_p=0.05)
PROMPT = "Hello"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def server_env(**extra):
    return child_env(drop=("MODEL", "CONFIG_FILE", "HOST", "PORT"), **extra)


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.headers.get("content-type", ""), response.read().decode()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(fixtures.write_fixture(MODEL, tmp_path_factory.mktemp("server-fixtures")))


@contextlib.contextmanager
def running_server(model, moe_slots, log):
    """`empanel-gguf serve` on a free loopback port; yields its base URL; always killed."""
    port = free_port()
    cmd = [sys.executable, "-m", "empanel_gguf", "serve", str(model), "--moe-slots", str(moe_slots),
           "--n_ctx", str(N_CTX), "--host", "127.0.0.1", "--port", str(port), "--verbose", "false"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=server_env(), stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, f"{base}/v1/models", log, START_TIMEOUT)
        yield base
        assert proc.poll() is None, f"the server died:\n{log.read_text()}"
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    with running_server(model, SLOTS, log) as base:
        yield base, log


@pytest.fixture(scope="module")
def client(server):
    base, _ = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def reference(model):
    """The in-process answers: completion and chat, streamed and not, at temperature 0."""
    llm = Llama(model, moe_slots=SLOTS, n_ctx=N_CTX, logits_all=True, verbose=False)
    try:
        kw = dict(max_tokens=12, temperature=0, **SERVER_DEFAULTS)
        out = {
            "completion": llm.create_completion(PROMPT, **kw)["choices"][0]["text"],
            "completion_stream": "".join(c["choices"][0]["text"]
                                         for c in llm.create_completion(PROMPT, stream=True, **kw)),
            "chat": llm.create_chat_completion(MESSAGES, **kw)["choices"][0]["message"]["content"],
            "chat_stream": "".join(c["choices"][0]["delta"].get("content") or ""
                                   for c in llm.create_chat_completion(MESSAGES, stream=True, **kw)),
        }
    finally:
        llm.close()
    return out


def ask(client, kind, stream):
    """One request like the reference's; returns the text."""
    if kind == "completion":
        result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                           stream=stream)
        if stream:
            return "".join(chunk.choices[0].text for chunk in result)
        return result.choices[0].text
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                            temperature=0, stream=stream)
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in result if chunk.choices)
    return result.choices[0].message.content


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_answers_equal_in_process_llama(client, reference, kind, stream):
    want = reference[f"{kind}_stream" if stream else kind]
    assert ask(client, kind, stream) == want


def test_two_requests_at_once(client, reference):
    """Both answers complete and are right: requests queue (interrupt_requests is false)."""
    jobs = [("completion", True), ("chat", False), ("chat", True), ("completion", False)]
    results, errors = {}, []

    def one(kind, stream):
        try:
            results[(kind, stream)] = ask(client, kind, stream)
        except Exception as e:  # reported below, with the request
            errors.append((kind, stream, e))

    for pair in (jobs[:2], jobs[2:]):  # two at a time
        threads = [threading.Thread(target=one, args=job) for job in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=REQUEST_TIMEOUT * 2)
        assert not any(t.is_alive() for t in threads), "a request did not finish"
    assert not errors, errors
    for kind, stream in jobs:
        assert results[(kind, stream)] == reference[f"{kind}_stream" if stream else kind], (kind, stream)


def test_stats_endpoints(server, client):
    base, _ = server
    ask(client, "completion", False)  # some traffic
    status, kind, body = get(f"{base}/v1/empanel/stats")
    assert status == 200 and kind.startswith("application/json")
    stats = json.loads(body)
    assert stats["slot_pools"] is True
    total = stats["total"]
    assert total["n_slots"] == SLOTS * 3  # 3 MoE layers
    assert total["hits"] + total["misses"] > 0 and total["bytes_read"] > 0
    assert 0.0 <= total["hit_rate"] <= 1.0 and "read_gbps" in total
    assert set(stats["layers"]) == {"0", "1", "2"}
    assert stats["memory"]["available_bytes"] > 0 and stats["memory"]["estimated_bytes"] > 0
    assert "bytes_read_per_s" in stats["recent"]

    status, kind, body = get(f"{base}/metrics")
    assert status == 200 and kind.startswith("text/plain")
    assert "# TYPE empanel_expert_hits_total counter" in body
    assert 'empanel_expert_hits_total{model="' in body and 'layer="0"}' in body
    rate = [line for line in body.splitlines() if line.startswith("empanel_hit_rate{")]
    assert len(rate) == 1 and 0.0 <= float(rate[0].rsplit(" ", 1)[1]) <= 1.0
    assert "empanel_read_bytes_per_second" in body and "empanel_memory_available_bytes" in body


def test_models_lists_the_model(client, model):
    assert [m.id for m in client.models.list().data] == [model]


def test_config_file_settings_take_moe_slots(tmp_path, model):
    from empanel_gguf.commands import serve

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"host": "127.0.0.1", "port": 9999, "models": [
        {"model": model, "model_alias": "a", "moe_slots": 8, "n_ctx": 256},
        {"model": model, "model_alias": "b", "moe_slots": "25%", "mem_floor": "2GiB"},
    ]}))
    args = serve.setup_arg_parser().parse_args(["--config_file", str(config)])
    server_settings, models, builtin = serve.settings_from_args(args)
    assert (server_settings.host, server_settings.port, builtin) == ("127.0.0.1", 9999, False)
    assert [(m.model_alias, m.moe_slots, m.n_ctx) for m in models] == [("a", "8", 256), ("b", "25%", 2048)]
    assert models[1].mem_floor == "2GiB"

    args = serve.setup_arg_parser().parse_args([model, "-ms", "6", "-c", "128", "--force"])
    server_settings, models, _ = serve.settings_from_args(args)
    assert (server_settings.host, server_settings.port) == ("127.0.0.1", 8080)
    assert server_settings.interrupt_requests is False
    assert (models[0].model, models[0].moe_slots, models[0].n_ctx, models[0].force) == (model, "6", 128, True)


def test_serve_refuses_what_does_not_fit(model):
    proc = subprocess.run(
        [sys.executable, "-m", "empanel_gguf", "serve", model, "--moe-slots", "8", "--mem-floor", "0",
         "--port", str(free_port())],
        cwd=REPO, env=server_env(EMPANEL_MEM_AVAILABLE="100KiB"), capture_output=True, text=True,
        timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "refused" in proc.stderr and "--force" in proc.stderr


def post_raw(url, body, timeout=10):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("body", [b'{"prompt": "Hello", "max_tokens": 4', b"not json at all",
                                  b'{"prompt": "Hello", "max_tokens": "four"}', b'{"messages": 3}'],
                         ids=["cut-short", "not-json", "bad-type", "bad-messages"])
def test_bad_requests_get_400_with_a_message(server, body):
    """Malformed JSON and bad parameters are the client's error: 400 and what is wrong, not 500;
    the server goes on serving."""
    base, _ = server
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, text = post_raw(base + path, body)
    assert status == 400, (status, text)
    assert "error" in json.loads(text) and json.loads(text)["error"]["message"]
    assert get(f"{base}/v1/models")[0] == 200


# the server under load: the built-in model at 25 % slots, 32 clients x 4 requests each
N_CLIENTS = 32
PER_CLIENT = 4
N_DROPPING = 4  # clients whose first request is a stream they hang up on after the first chunk
LOAD_TIMEOUT = 180


def hang_up_mid_stream(base):
    """Start a streamed completion over a raw socket, read until its first event, hang up."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 64, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        seen = b""
        while b"data:" not in seen:
            chunk = sock.recv(4096)
            assert chunk, "the server closed before streaming anything"
            seen += chunk


def test_server_under_load_answers_every_request(tmp_path):
    """Every request answered (or refused with a clear status), none lost; the same greedy text
    for the same request, under load or alone; clients hanging up mid-stream leave it serving."""
    from empanel_gguf.commands.options import BUILTIN_MODEL

    with running_server(BUILTIN_MODEL, "25%", tmp_path / "server.log") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=LOAD_TIMEOUT, max_retries=0)
        kinds = [("completion", False), ("chat", True), ("completion", True), ("chat", False)]
        alone = {job: ask(client, *job) for job in kinds}
        assert all(alone.values())
        answers, failures, refused = [], [], []

        def one_client(c):
            for r in range(PER_CLIENT):
                job = kinds[(c + r) % len(kinds)]
                try:
                    if c < N_DROPPING and r == 0:
                        hang_up_mid_stream(base)
                        continue
                    answers.append((job, ask(client, *job)))
                except openai.APIStatusError as e:  # a clear refusal is allowed, not a silent loss
                    refused.append((job, e.status_code, e.message))
                except Exception as e:  # reported below
                    failures.append((c, r, job, repr(e)))

        t0 = time.monotonic()
        threads = [threading.Thread(target=one_client, args=(c,)) for c in range(N_CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(1.0, LOAD_TIMEOUT - (time.monotonic() - t0)))
        assert not any(t.is_alive() for t in threads), "requests still unanswered"
        assert not failures, failures[:5]
        assert all(status in (429, 503) for _, status, _ in refused), refused[:5]
        expected = N_CLIENTS * PER_CLIENT - N_DROPPING
        assert len(answers) + len(refused) == expected
        wrong = [(job, text) for job, text in answers if text != alone[job]]
        assert not wrong, wrong[:3]
        # still serving, and it counted the work
        assert ask(client, "completion", False) == alone[("completion", False)]
        stats = json.loads(get(f"{base}/v1/empanel/stats")[2])
        assert stats["total"]["misses"] > 0


def test_metrics_escape_labels_as_the_programs_do(tmp_path):
    """/metrics of `empanel-gguf serve` and of llama.cpp's programs come from one writer
    (csrc/metrics.c): a model path with a quote and a backslash reads the same in both, and every
    label of the server's text (its own gauges too) escapes a newline, a quote and a backslash as
    the text format says (a plan refuses a newline in a path, an alias may have one)."""
    from empanel_gguf import server
    from empanel_gguf.engine.native import native

    path = tmp_path / 'a"b\\c.gguf'
    fixtures.write_fixture("qwen3moe-f32", tmp_path).rename(path)
    llm = Llama(str(path), n_ctx=64, verbose=False, moe_slots=4)
    llm.create_completion(PROMPT, max_tokens=2)

    class Proxy:  # the server's model proxy, holding this one model under `alias`
        _swap = threading.RLock()

        def __init__(self, alias):
            self.alias = alias

        def current(self):
            return self.alias, llm

        def snapshot(self, timeout=1.0):
            return self.alias, llm.moe_stats(), {}

    def series(text, family):
        return sorted(line for line in text.splitlines() if line.startswith(family + "{"))

    n = native()
    buf = n.ffi.new("char[]", 1 << 20)
    n.sidecar.empanel_program_metrics(buf, 1 << 20)
    programs = n.ffi.string(buf).decode()
    served = server.metrics_text(Proxy(str(path)), None)
    label = 'model="' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'
    for family in ("empanel_slot_pools", "empanel_expert_hits_total", "empanel_read_bytes_total"):
        mine = series(served, family)
        assert mine and all(label in line for line in mine), mine
        assert mine == [line for line in series(programs, family) if label in line], family

    served = server.metrics_text(Proxy('x\n"y\\'), None)
    for family in ("empanel_slot_pools", "empanel_expert_hits_total", "empanel_hit_rate"):
        lines = series(served, family)
        assert lines and all(line.startswith(family + '{model="x\\n\\"y\\\\"') for line in lines), lines
