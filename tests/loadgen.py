"""`empanel-gguf llama-server` in a test, and a load on its OpenAI-style API as many clients make
it (tests/test_programs.py, tests/test_rpc.py): completions and chat, streamed and not, clients
that hang up mid-stream, and malformed requests. Standard library only (urllib, sockets, threads)."""

import concurrent.futures
import contextlib
import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

from conftest import child_env, free_port, stop_process, wait_until_serving

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT = 45
THREADS = "2"


@contextlib.contextmanager
def llama_server(model, moe_slots, log, *extra, env_extra=None):
    """`empanel-gguf llama-server` on a free loopback port; yields (base URL, process); always
    stopped (SIGTERM, which the wrapper passes on)."""
    port = free_port()
    cmd = [sys.executable, "-m", "empanel_gguf", "llama-server", "--moe-slots", moe_slots, "-m", model,
           "-np", "4", "-c", "2048", "-t", THREADS, "--host", "127.0.0.1", "--port", str(port), "--metrics", *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(**(env_extra or {})), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, f"{base}/health", log, START_TIMEOUT, what="llama-server")
        yield base, proc
    finally:
        stop_process(proc, timeout=20, group=True)


PROMPTS = ["ROMEO:", "JULIET:", "First Citizen:", "KING HENRY:", "Once upon a time", "MERCUTIO:"]

# (path, body): each is the client's mistake, answered with a 4xx status
MALFORMED = [
    ("/v1/completions", b'{"prompt": "ROMEO:", "max_tokens": 8'),                           # JSON cut short
    ("/v1/chat/completions", b"not json at all"),                                           # not JSON
    ("/v1/completions", b""),                                                               # no body
    ("/v1/completions", json.dumps({"max_tokens": 8}).encode()),                            # no prompt
    ("/v1/chat/completions", json.dumps({"messages": "hello"}).encode()),                   # not a list
    ("/v1/completions", json.dumps({"prompt": "ROMEO:", "max_tokens": "ten"}).encode()),    # not a number
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user"}]}).encode()),        # no content
    ("/v1/completions", json.dumps({"prompt": "ROMEO:", "max_tokens": -5}).encode()),       # out of range
]


def post(base, path, body, timeout=120):
    """(status, body text) of one POST; a 4xx/5xx answer is returned, not raised."""
    request = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def ask(base, prompt, chat, stream, max_tokens=12, timeout=120):
    """One request as a client makes it, greedy: dict(status, text, error). A stream's text is its
    events' text; an error event in a stream (sent after status 200) is its error."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    result = dict(status=None, text="", error=None, chat=chat, stream=stream)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            result["status"] = response.status
            if not stream:
                choice = json.loads(response.read())["choices"][0]
                result["text"] = choice["message"]["content"] if chat else choice["text"]
                return result
            for raw in response:
                line = raw.decode(errors="replace").strip()
                if line.startswith("error:") or (line.startswith("data:") and '"error"' in line):
                    result["error"] = line
                    continue
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data:"):])
                for choice in event.get("choices") or []:
                    part = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    result["text"] += part or ""
    except urllib.error.HTTPError as e:
        result["status"] = e.code
        result["error"] = e.read().decode(errors="replace")
    except OSError as e:  # reset, refused, timed out: no answer
        result["error"] = f"{type(e).__name__}: {e}"
    return result


def hang_up(base, timeout=60):
    """Open a streamed completion, read its first event, close the socket: True if an event came."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 200, "stream": True, "temperature": 0})
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        got = b""
        while b"data:" not in got:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    return b"data:" in got


def run_load(base, n_clients=32, per_client=4, hang_ups=4, after=None):
    """n_clients clients at once, each making per_client requests in turn; the first request of
    the first `hang_ups` clients hangs up mid-stream. Request j of client i is a chat when i + j
    is odd, streamed when i // 2 + j is odd. The MALFORMED requests go alongside. after: (count,
    fn): fn() is called once, when `count` requests have been answered (a fault mid-load).
    Returns dict(answers=[ask() results], hung_up=[bool], malformed=[(status, body)])."""
    lock = threading.Lock()
    done = [0]

    def answered():
        with lock:
            done[0] += 1
            fire = after is not None and done[0] == after[0]
        if fire:
            after[1]()

    def client(i):
        answers, hung = [], []
        for j in range(per_client):
            if j == 0 and i < hang_ups:
                hung.append(hang_up(base))
            else:
                answers.append(ask(base, PROMPTS[(i + j) % len(PROMPTS)], chat=(i + j) % 2 == 1,
                                   stream=(i // 2 + j) % 2 == 1))
            answered()
        return answers, hung

    with concurrent.futures.ThreadPoolExecutor(n_clients + 1) as pool:
        malformed = pool.submit(lambda: [post(base, path, body) for path, body in MALFORMED])
        results = list(pool.map(client, range(n_clients)))
        bad = malformed.result()
    return dict(answers=[a for answers, _ in results for a in answers],
                hung_up=[h for _, hung in results for h in hung], malformed=bad)
