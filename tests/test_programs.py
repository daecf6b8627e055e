"""llama.cpp's own programs on slot pools: `empanel-gguf llama-server|llama-cli|llama-bench|llama-perplexity`.

The programs are the real llama.cpp ones, built from the same patched tree (EMPANEL_PROGRAMS=ON),
run as subprocesses on the built-in model and fixtures; the plan reaches the sidecar inside them
through EMPANEL_PLAN. Each program with slot pools is compared with the same program without:
the same perplexity bit for bit, the same greedy text, the same answers of llama-server with
continuous batching (-np 4) over loopback HTTP. Without the programs (a build without
EMPANEL_PROGRAMS) these tests are skipped, unless EMPANEL_REQUIRE_PROGRAMS=1 (CI) makes that a
failure (conftest.require_programs); the programs' command line and the message of a missing one
are tested without them, in tests/test_cli.py.
"""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import loadgen
import pytest
from conftest import child_env, require_programs
from loadgen import llama_server

from empanel_gguf.engine.native import uring_available
from empanel_gguf.models import fixtures
from empanel_gguf.commands import programs
from empanel_gguf.commands.options import BUILTIN_MODEL
from empanel_gguf.planning.index import load_index
from empanel_gguf.planning.plan import pool_setup
from empanel_gguf.planning.plan_file import plan_text
from empanel_gguf.planning.sizing import plan_slots

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds for one program run
THREADS = "2"

@pytest.fixture(autouse=True)
def _programs_built():
    """Every test here runs llama.cpp's programs (the ones that need none: tests/test_cli.py)."""
    require_programs()


def run_program(name, *args, env_extra=None, stdin=subprocess.DEVNULL):
    """`empanel-gguf <name> args...` to the end: CompletedProcess with text output."""
    cmd = [sys.executable, "-m", "empanel_gguf", name, *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=child_env(**(env_extra or {})), stdin=stdin, capture_output=True,
                          text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def model():
    assert BUILTIN_MODEL.is_file(), "the built-in model is part of the package"
    return str(BUILTIN_MODEL)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from empanel_gguf.planning.profile import DEFAULT_TEXT

    path = tmp_path_factory.mktemp("programs-text") / "text.txt"
    path.write_text(DEFAULT_TEXT * 2)
    return path


def test_program_without_a_model_runs_as_it_is():
    proc = run_program("llama-bench", "--help")
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]
    assert "runs without slot pools" in proc.stderr


def test_program_refuses_a_malformed_plan(tmp_path):
    path = fixtures.write_fixture("qwen3moe-q4_0", tmp_path)
    index = load_index(path)
    good = plan_text(index, pool_setup(index, plan_slots(index, "25%")))
    bench = programs.program_path("llama-bench")
    shape = next(line for line in good.splitlines() if line.startswith("shape "))
    params = next(line for line in good.splitlines() if line.startswith("params ")).split()
    negative_budget = " ".join(params[:5] + ["-5"] + params[6:])  # strtoull would wrap it
    cases = {
        "a bad 'guess' record": good.replace("\nguess 1\n", "\nguess 1 7\n"),      # a field too many
        "a bad 'shape' record": good.replace(shape, shape + "\n" + shape),         # twice
        "incomplete plan": good.replace("\npreload 0\n", "\n"),                   # a required record missing
        "a bad 'params' record": good.replace(" ".join(params), negative_budget),
        "a bad 'host-cache' record": good.replace("\npreload 0\n", "\npreload 0\nhost-cache -1\n"),
        # read, then refused at the bind: this build's pools are in host memory
        "no pool is in device memory": good.replace("\npreload 0\n", "\npreload 0\nhost-cache 1048576\n"),
    }
    for expected, text in cases.items():
        assert text != good, expected
        plan = tmp_path / "plan.txt"
        plan.write_text(text)
        proc = subprocess.run([bench, "-m", path, "-p", "8", "-n", "0", "-r", "1"], env=child_env(EMPANEL_PLAN=str(plan)),
                              capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode != 0 and expected in proc.stderr, (expected, proc.stderr[-1500:])


def test_llama_bench_prints_its_table_with_pools(model, tmp_path):
    stats_json = tmp_path / "stats.json"
    proc = run_program("llama-bench", "--moe-slots", "25%", "--moe-stats-json", stats_json, "-m", model,
                       "-p", "32", "-n", "8", "-r", "1", "-t", THREADS)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert any(re.search(r"\|\s+pp32\s+\|", row) for row in rows), proc.stdout
    assert any(re.search(r"\|\s+tg8\s+\|", row) for row in rows), proc.stdout
    loads = json.loads(stats_json.read_text())
    ran = [load["total"] for load in loads if load["total"]["n_remaps"]]
    assert ran, loads
    assert ran[-1]["misses"] > 0 and ran[-1]["bytes_read"] > 0 and ran[-1]["n_slots"] > 0
    assert re.search(r"empanel: \d+ hits, \d+ misses", proc.stderr), proc.stderr
    assert "outputs bit-identical to llama.cpp --no-repack" in proc.stderr  # paging: auto chose plain pools
    assert loads[-1]["exact_to"] == "llama.cpp --no-repack"
    assert loads[-1]["read_io"] == ("uring" if uring_available()[0] else "threads")  # the plan's io record


def test_programs_take_moe_repack_off_as_no_repack(model, text_file):
    """--moe-repack off reaches llama.cpp's programs as their own flag: llama-bench's --repack 0
    (its rpk column), the others' --no-repack; llama-perplexity over plain pools equals stock's
    with --no-repack."""
    proc = run_program("llama-bench", "--moe-slots", "25%", "--moe-repack", "off", "-m", model,
                       "-p", "32", "-n", "8", "-r", "1", "-t", THREADS)
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| model"))
    assert "rpk" in header, proc.stdout
    assert "outputs bit-identical to llama.cpp --no-repack" in proc.stderr, proc.stderr[-1500:]
    paged = _ppl_values(_perplexity(model, text_file, "25%", "--moe-repack", "off"))
    stock = _ppl_values(_perplexity(model, text_file, "none", "--no-repack"))
    assert paged == stock


def _perplexity(model, text_file, moe_slots, *extra):
    """llama-perplexity's output (stdout and stderr) with -c 128 -b 128."""
    proc = run_program("llama-perplexity", "--moe-slots", moe_slots, "-m", model, "-f", text_file, "-c", "128",
                       "-b", "128", "-t", THREADS, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _ppl_values(out):
    chunks = re.findall(r"\[\d+\]\d+\.\d+", out)
    final = re.search(r"Final estimate: PPL = [0-9.]+ \+/- [0-9.]+", out)
    assert chunks and final, out[-3000:]
    return chunks, final.group(0)


@pytest.mark.parametrize("fixture", [None, "mixtral", "qwen3moe-q4_k"])
def test_llama_perplexity_same_with_and_without_slots(model, text_file, fixture, tmp_path):
    path = model if fixture is None else str(fixtures.write_fixture(fixture, tmp_path))
    stock = _perplexity(path, text_file, "none", "--no-repack")  # the layout paged pools choose (auto)
    paged = _perplexity(path, text_file, "25%")
    assert "outputs bit-identical to llama.cpp --no-repack" in paged
    assert "runs without slot pools" in stock
    assert re.search(r"empanel: \d+ hits, \d+ misses", paged)
    assert _ppl_values(paged) == _ppl_values(stock)  # every chunk's value, printed to 4 decimals


def test_llama_perplexity_with_preloaded_pools(model, text_file):
    """Preloading (--moe-preload on, or a calibration profile) after the program's own sizing
    load: llama.cpp's common first loads the model without memory (no_alloc) to fit it, and that
    load must bind and preload nothing."""
    stock = _perplexity(model, text_file, "none")
    paged = _perplexity(model, text_file, "25%", "--moe-preload", "on")
    assert re.search(r"empanel: preloaded \d+ experts", paged), paged[-3000:]
    assert _ppl_values(paged) == _ppl_values(stock)


def _kl_report(out):
    """The statistics llama-perplexity --kl-divergence prints (KLD, Δp, top-token agreement)."""
    lines = [line.split(" I ", 1)[-1].strip() for line in out.splitlines()
             if re.search(r"(KLD|Δp|Same top p|PPL|ln\(PPL)", line)]
    assert any("Mean    KLD" in line or "Mean KLD" in line.replace("  ", " ") for line in lines), out[-3000:]
    return lines


def test_llama_perplexity_kl_divergence_is_stock_s(model, text_file, tmp_path):
    """--kl-divergence against stock's saved logits (stored as 16-bit log-probs, so even stock
    against itself shows a tiny KLD): with slot pools every statistic is stock's own."""
    base = tmp_path / "stock.kld"
    _perplexity(model, text_file, "none", "--kl-divergence-base", base)
    assert base.stat().st_size > 0
    stock = _kl_report(_perplexity(model, text_file, "none", "--kl-divergence-base", base, "--kl-divergence"))
    paged = _kl_report(_perplexity(model, text_file, "25%", "--kl-divergence-base", base, "--kl-divergence"))
    assert paged == stock
    # what routing substitution costs, measured the way llama.cpp users measure quantization
    subst = _perplexity(model, text_file, "25%", "--moe-subst", "0.5", "--kl-divergence-base", base,
                        "--kl-divergence")
    assert "APPROXIMATE" in subst
    mean = {name: float(re.search(r"Mean\s+KLD:\s+(-?[0-9.]+)", "\n".join(lines)).group(1))
            for name, lines in (("stock", stock), ("subst", _kl_report(subst)))}
    assert mean["subst"] > mean["stock"], mean


def _cli_text(model, moe_slots):
    proc = run_program("llama-cli", "--moe-slots", moe_slots, "-m", model, "-p", "ROMEO:", "-n", "24",
                       "--temp", "0", "-t", THREADS, "-st", "--simple-io")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_llama_cli_completes_a_prompt(model):
    paged = _cli_text(model, "25%")
    stock = _cli_text(model, "none")
    reply = paged.stdout.split("ROMEO:", 1)[-1].strip()
    assert len(reply) > 10, paged.stdout
    assert paged.stdout.split("[ Prompt")[0] == stock.stdout.split("[ Prompt")[0]
    assert re.search(r"empanel: \d+ hits, \d+ misses", paged.stderr)


def test_program_refuses_a_changed_model_file(tmp_path):
    path = fixtures.write_fixture("qwen3moe-q4_0", tmp_path)
    index = load_index(path)
    setup = pool_setup(index, plan_slots(index, "25%"))
    plan = tmp_path / "plan.txt"
    plan.write_text(plan_text(index, setup))
    os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns + 10**9))  # as a rewrite would
    bench = programs.program_path("llama-bench")
    env = child_env(EMPANEL_PLAN=str(plan))
    proc = subprocess.run([bench, "-m", path, "-p", "8", "-n", "0", "-r", "1"], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode != 0
    assert "changed since empanel-gguf planned the load" in proc.stderr, proc.stderr[-2000:]

    plan.write_text(plan_text(load_index(path), setup).replace("end\n", ""))  # truncated
    proc = subprocess.run([bench, "-m", path, "-p", "8", "-n", "0", "-r", "1"], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode != 0 and "incomplete plan" in proc.stderr, proc.stderr[-2000:]


def test_plan_for_another_model_loads_it_as_usual(model, tmp_path):
    other = fixtures.write_fixture("qwen3moe-q4_0", tmp_path)
    index = load_index(other)
    plan = tmp_path / "plan.txt"
    plan.write_text(plan_text(index, pool_setup(index, plan_slots(index, "25%")), stats_path=tmp_path / "s.jsonl"))
    proc = subprocess.run([programs.program_path("llama-bench"), "-m", model, "-p", "8", "-n", "0", "-r", "1",
                           "-t", THREADS], env=child_env(EMPANEL_PLAN=str(plan)), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pp8" in proc.stdout and not (tmp_path / "s.jsonl").exists()


# -- llama-server ---------------------------------------------------------------------------------


PROMPTS = ["ROMEO:", "JULIET:", "First Citizen:", "KING HENRY:"]


def _ask_all(base):
    """The four prompts at once (one OpenAI client each), greedy, 24 tokens: their texts."""
    openai = pytest.importorskip("openai", reason="the openai client is missing: pip install openai")

    def ask(prompt):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60, max_retries=0)
        if prompt == PROMPTS[1]:  # one of them as a chat, streamed
            stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=24, temperature=0, stream=True)
            return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        return client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, PROMPTS))


def test_llama_server_parallel_requests_equal_stock(model, tmp_path):
    # stock as the paged server's exact_to names it: its pools page, so the plan gave it -b / -ub
    # 2048 and -fa on (the context is 2048)
    with llama_server(model, "none", tmp_path / "stock.log", "-b", "2048", "-ub", "2048", "-fa", "on") as (base, _):
        stock = _ask_all(base)
    with llama_server(model, "25%", tmp_path / "paged.log") as (base, proc):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            hang_up = pool.submit(loadgen.hang_up, base)  # alongside the four
            paged = _ask_all(base)
            assert hang_up.result(timeout=60)
        again = _ask_all(base)  # the server goes on after the hang-up
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        misses = metric_value(base, "empanel_expert_misses_total")
        with urllib.request.urlopen(f"{base}/slots", timeout=10) as response:
            n_slots = len(json.loads(response.read()))
    assert n_slots == 4
    assert all(len(text) > 0 for text in stock)
    assert paged == stock and again == stock
    assert misses > 0, metrics[-2000:]
    assert "llamacpp:prompt_tokens_total" in metrics  # llama-server's own series are still there
    assert re.search(r"empanel_hit_rate\{model=\"[^\"]+\"\} [0-9.]+", metrics)
    log = (tmp_path / "paged.log").read_text()
    assert re.search(r"empanel: \d+ hits, \d+ misses", log), log[-2000:]  # the statistics at exit
    assert "outputs bit-identical to llama.cpp --no-repack -b 2048 -ub 2048 -fa on" in log, log[-2000:]


def test_llama_server_under_load(model, tmp_path):
    """32 clients x 4 requests at 25 % slots, -np 4: completions and chat, streamed and not, four
    hang up mid-stream; 8 malformed requests alongside. Every one of the 124 is answered 200 with
    text, the 8 with a 4xx status (llama-server answered a body that is not JSON with 500: patch
    0007 makes it 400), the server serves afterwards and /metrics counts the reads. Texts are not
    compared one by one: continuous batching changes a few greedy texts, with or without slots."""
    with llama_server(model, "25%", tmp_path / "load.log") as (base, proc):
        before = metric_value(base, "empanel_read_bytes_total")
        load = loadgen.run_load(base)
        after = loadgen.ask(base, "ROMEO:", chat=False, stream=False)
        bytes_read = metric_value(base, "empanel_read_bytes_total") - before
        alive = proc.poll() is None
    answers = load["answers"]
    assert len(answers) == 124 and len(load["hung_up"]) == 4 and all(load["hung_up"])
    failed = [a for a in answers if a["status"] != 200 or a["error"] or not a["text"]]
    assert not failed, failed[:4]
    assert {(a["chat"], a["stream"]) for a in answers} == {(c, s) for c in (False, True) for s in (False, True)}
    statuses = [status for status, _ in load["malformed"]]
    assert all(400 <= status < 500 for status in statuses), load["malformed"]
    assert alive and after["status"] == 200 and after["text"]
    assert bytes_read > 0


def test_llama_server_read_failure_fails_the_request_not_the_server(model, tmp_path):
    log = tmp_path / "fault.log"
    # reads from the 200th request on fail: the warmup passes, the first prompt's reads fail
    with llama_server(model, "25%", log, env_extra={"EMPANEL_FAULT_READ_AFTER": "200"}) as (base, proc):
        request = urllib.request.Request(f"{base}/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"prompt": "ROMEO:", "max_tokens": 8}).encode())
        with pytest.raises(urllib.error.HTTPError) as failure:
            urllib.request.urlopen(request, timeout=60)
        assert failure.value.code == 500
        with urllib.request.urlopen(f"{base}/health", timeout=10) as response:
            assert response.status == 200
        assert proc.poll() is None
    assert "EMPANEL_FAULT_READ_AFTER" in log.read_text()  # the sidecar's message is in the log


def test_llama_server_speculative_decoding_over_the_pools(model, tmp_path):
    """A draft model proposes tokens and the target checks them in one batch: over slot pools the
    verification batches are batches like any other, so the answers are stock's with the same
    draft. The draft is a copy of the model at another path: the plan is the target's only."""
    import shutil

    draft = tmp_path / "draft.gguf"
    shutil.copyfile(model, draft)
    spec = ("--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max", "4")

    def ask(base):
        body = {"prompt": "ROMEO:", "n_predict": 32, "temperature": 0}
        request = urllib.request.Request(f"{base}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    with llama_server(model, "none", tmp_path / "stock.log", *spec) as (base, _):
        stock = ask(base)
    with llama_server(model, "25%", tmp_path / "paged.log", *spec) as (base, _):
        paged = ask(base)
        misses = metric_value(base, "empanel_expert_misses_total")
    assert stock["timings"].get("draft_n", 0) > 0, stock["timings"]  # the draft did propose tokens
    assert paged["content"] == stock["content"] and len(paged["content"]) > 10
    assert paged["timings"]["draft_n_accepted"] == stock["timings"]["draft_n_accepted"]
    assert misses > 0
    log = (tmp_path / "paged.log").read_text()
    assert len(re.findall(r"empanel: (?:load \d+ of \d+: )?\d+ hits", log)) >= 1, log[-2000:]


def metric_value(base, name):
    """The sum of a Prometheus series over its labels, from /metrics."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))
