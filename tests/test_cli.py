"""The command line: `run` (completion, chat, env defaults, report, memory guard), `exec`, and the
memory guard's estimate, refusal and watchdog.

Commands run as real subprocesses (`python -m empanel_gguf ...`) on tiny fixture models, with the
checkout first on PYTHONPATH; outputs at temperature 0 are compared with the in-process Llama.
"""

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import child_env

from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.planning import estimate, guard, host_memory, plan
from empanel_gguf.commands import programs as programs_cmd
from empanel_gguf.planning.index import load_index
from empanel_gguf.planning.sizing import plan_slots

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 60  # seconds, any one command
MODEL = "qwen3moe-q8_0"  # 3 layers, 16 experts (top-4), context 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(fixtures.write_fixture(MODEL, tmp_path_factory.mktemp("cli-fixtures")))


def cli_env(**extra):
    return child_env(**extra)


def cli(*args, env=None, stdin=None, cwd=REPO, prefix=None):
    cmd = (prefix or [sys.executable, "-m", "empanel_gguf"]) + [str(a) for a in args]
    return subprocess.run(cmd, cwd=cwd, env=env or cli_env(), input=stdin, capture_output=True,
                          text=True, timeout=TIMEOUT)


def report(proc):
    assert "empanel: report" in proc.stderr, proc.stderr
    return proc.stderr.split("empanel: report", 1)[1]


# ---------------------------------------------------------------------------------------------
# run


def test_run_prompt_streams_with_report(model):
    proc = cli("run", model, "-p", "Hello", "-n", 8, "--temp", 0, "--moe-slots", 8)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Hello")
    rep = report(proc)
    assert re.search(r"prompt +\d+ tokens in [\d.]+ s: [\d.]+ tok/s", rep), rep
    assert re.search(r"decode +\d+ tokens in [\d.]+ s: [\d.]+ tok/s", rep), rep
    assert re.search(r"hit rate [\d.]+% \(\d+ hits, \d+ misses\): .* read in [\d.]+ s, [\d.-]+ GB/s", rep), rep
    assert re.search(r"peak RSS +[\d.]+ MiB", rep), rep
    assert "8 of 16 per MoE layer" in rep
    assert "exact     bit-identical to llama.cpp --no-repack" in rep  # paging: auto chose plain pools
    assert "indexed" in proc.stderr and "loaded" in proc.stderr  # progress while loading
    notices = [line for line in proc.stderr.splitlines() if line.startswith("empanel:")]
    assert notices and max(map(len, notices)) <= 120, [n for n in notices if len(n) > 120]  # a line a notice

    # the streamed text is the in-process Llama's at temperature 0 (streamed too: llama-cpp-python
    # drops the bytes of a token that are not valid UTF-8 when streaming, not otherwise)
    llm = Llama(model, moe_slots=8, n_ctx=512, verbose=False)
    try:
        want = "".join(chunk["choices"][0]["text"] for chunk in
                       llm.create_completion("Hello", max_tokens=8, temperature=0, stream=True))
    finally:
        llm.close()
    assert proc.stdout == "Hello" + want + "\n"


def test_run_decode_options_keep_the_text(model, tmp_path):
    # read-ahead, a resident first layer and a profile change reads, never the text
    plain = cli("run", model, "-p", "Hello", "-n", 8, "--temp", 0, "--moe-slots", 8)
    profile = tmp_path / "profile.json"
    assert cli("calibrate", model, "-n", 32, "-o", profile).returncode == 0
    tuned = cli("run", model, "-p", "Hello", "-n", 8, "--temp", 0, "--moe-slots", 8, "--moe-prefetch", 1,
                "--moe-resident-layers", 1, "--moe-profile", profile)
    assert tuned.returncode == 0, tuned.stderr
    assert tuned.stdout == plain.stdout
    rep = report(tuned)
    assert re.search(r"guess +recall [\d.]+% of the routed experts; read ahead \d+ experts", rep), rep
    assert re.search(r"preload +\d+ experts read into the pools at load", rep), rep  # the profile's
    assert "the first 1 MoE layers keep" in tuned.stderr


def test_run_env_defaults_and_command_line_wins(model):
    env = cli_env(LLAMA_ARG_MOE_SLOTS="4", LLAMA_ARG_N_PREDICT="4", LLAMA_ARG_TEMP="0")
    proc = cli("run", model, "-p", "Hello", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "4 of 16 per MoE layer" in report(proc)

    proc = cli("run", model, "-p", "Hello", "--moe-slots", "none", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "none: all 16 experts of each layer resident" in report(proc)
    assert "hit rate" not in report(proc)

    proc = cli("run", "--help", env=env)
    text = " ".join(proc.stdout.split())  # argparse wraps lines anywhere
    assert "(default: 4, env: LLAMA_ARG_MOE_SLOTS)" in text, text
    assert "env: LLAMA_ARG_CTX_SIZE" in text and "env: LLAMA_ARG_N_GPU_LAYERS" in text
    # the built-in model completes the default prompt even on a terminal; the help says so
    assert "a MODEL given and a terminal on stdin: chat; else (the built-in model, or no terminal)" in text, text


def test_run_builtin_model_streams_by_default(tmp_path):
    proc = cli("run", "-n", 4, env=cli_env(XDG_CACHE_HOME=str(tmp_path)), stdin="")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time")
    rep = report(proc)
    assert "16 of 32 per MoE layer" in rep  # 50 % of the built-in model's experts
    assert "shakespeare-moe.gguf" in rep    # the shipped, trained model


def test_run_chat_over_a_pipe(model):
    proc = cli("run", model, "-cnv", "--temp", 0, "-n", 6, "--moe-slots", 8,
               stdin="Hi there\n/exit\nnot read\n")
    assert proc.returncode == 0, proc.stderr
    llm = Llama(model, moe_slots=8, n_ctx=512, verbose=False)
    try:
        chunks = llm.create_chat_completion([{"role": "user", "content": "Hi there"}], max_tokens=6,
                                            temperature=0, stream=True)
        want = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    finally:
        llm.close()
    assert proc.stdout == want + "\n"
    assert "decode" in report(proc)


def test_run_refuses_what_does_not_fit(model):
    # 100 KiB "available": the fixture's estimate (64 MiB of it runtime) cannot fit
    env = cli_env(EMPANEL_MEM_AVAILABLE="100KiB", LLAMA_ARG_CTX_SIZE="256")
    proc = cli("run", model, "-p", "Hello", "-n", 2, "--mem-floor", 0, env=env)
    assert proc.returncode == 3, proc.stderr
    assert "refused" in proc.stderr and "--force" in proc.stderr
    assert "KV cache (n_ctx 256)" in proc.stderr  # the context size came from LLAMA_ARG_CTX_SIZE
    assert "empanel: report" not in proc.stderr and proc.stdout == ""

    proc = cli("run", model, "-p", "Hello", "-n", 2, "--mem-floor", 0, "--force", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "warning" in proc.stderr and "empanel: report" in proc.stderr


def test_run_stops_when_memory_runs_low(model):
    # forced past the guard with less available than the floor: the watchdog stops the run
    env = cli_env(EMPANEL_MEM_AVAILABLE="1GiB")
    proc = cli("run", model, "-p", "Hello", "-n", -1, "--mem-floor", "2GiB", "--force", env=env)
    assert proc.returncode == 3, proc.stderr
    assert "stopping: available memory fell to 1.00 GiB, below the floor of 2.00 GiB" in proc.stderr
    assert "empanel: report" in proc.stderr  # stopped cleanly, with the report


def test_run_bad_slots_is_an_error(model):
    proc = cli("run", model, "-p", "Hello", "--moe-slots", 2)  # below top-4
    assert proc.returncode == 1
    assert "at least 4" in proc.stderr
    proc = cli("run", model, "-p", "Hello", "--moe-slots", "abc")  # no form of moe_slots: a usage error
    assert proc.returncode == 2
    assert "not auto, none, a count (32), a share (25%) or a size (6GiB)" in proc.stderr
    assert "indexed" not in proc.stderr  # before anything ran
    for flag, value, says in (("--moe-budget", "abc", 'a size ("4GiB")'), ("--mem-floor", "q", "a share (5%)"),
                              ("--moe-host-cache", "zz", 'a size ("8GiB")')):  # a bad value: usage, first
        proc = cli("run", model, "-p", "Hello", flag, value)
        assert proc.returncode == 2 and f"argument {flag}" in proc.stderr and says in proc.stderr, proc.stderr
        assert "indexed" not in proc.stderr
    from empanel_gguf.commands.serve import missing_server_modules

    # a misspelt option: a usage error naming the nearest (serve's options need its extra)
    for command in ("run",) + (() if missing_server_modules() else ("serve",)):
        proc = cli(command, model, "--moe-slotz", 8, "--ctx-sise=64")
        assert proc.returncode == 2 and "did you mean --moe-slots, --ctx-size?" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------
# exec

APP = textwrap.dedent("""
    import sys
    import llama_cpp
    print("hooks", hasattr(llama_cpp.llama_cpp._lib, "llama_empanel_api_version"))
    llm = llama_cpp.Llama(sys.argv[1], n_ctx=256, verbose=False)
    out = llm.create_completion("Hello", max_tokens=6, temperature=0)["choices"][0]["text"]
    stats = llm.moe_stats()
    print("slots", stats["total"]["n_slots"] if stats else None)
    print("lookups", stats["total"]["hits"] + stats["total"]["misses"] if stats else None)
    print("text", repr(out))
""")


def exec_prefix():
    """`empanel-gguf exec` started from the checkout, without putting the checkout on the
    program's own path: the bootstrap must find empanel_gguf by itself."""
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from empanel_gguf.cli import main; sys.exit(main())"
    return [sys.executable, "-c", code]


def test_exec_runs_an_unchanged_program(model, tmp_path):
    app = tmp_path / "app.py"
    app.write_text(APP)
    env = cli_env()
    env.pop("PYTHONPATH")
    proc = cli("exec", "--moe-slots", 4, "--", sys.executable, app, model, env=env, cwd=tmp_path,
               prefix=exec_prefix())
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["hooks"] == "True"
    assert lines["slots"] == "12"  # 4 slots in each of 3 layers
    assert int(lines["lookups"]) > 0
    llm = Llama(model, moe_slots=4, n_ctx=256, verbose=False)
    try:
        want = llm.create_completion("Hello", max_tokens=6, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()
    assert lines["text"] == repr(want)


def test_exec_chains_an_existing_sitecustomize_and_guards(model, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE'] = 'ran'\n")
    code = ("import os, llama_cpp; print(os.environ.get('OTHER_SITECUSTOMIZE'), "
            "'empanel_gguf.llama.Llama' in str(llama_cpp.Llama.__mro__))")
    env = cli_env(PYTHONPATH=f"{REPO}{os.pathsep}{other}")
    proc = cli("exec", "--moe-slots", "none", "--", sys.executable, "-c", code, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ran", "True"]

    # the memory guard refuses inside the program, with MemoryRefused
    code = ("import sys, llama_cpp\ntry:\n    llama_cpp.Llama(sys.argv[1], verbose=False)\n"
            "except Exception as e:\n    print(type(e).__name__)\n")
    env = cli_env(EMPANEL_MEM_AVAILABLE="100KiB")
    proc = cli("exec", "--moe-slots", 4, "--mem-floor", 0, "--", sys.executable, "-c", code, model,
               env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "MemoryRefused"


def test_exec_hands_moe_options_to_the_program(model, tmp_path):
    """--moe-elastic and --moe-budget (and any LLAMA_ARG_MOE_* variable) reach the program's
    Llama(...) calls."""
    index = load_index(model)
    floor = sum(index.n_expert_used * layer.expert_bytes for layer in index.layers)
    code = ("import sys, llama_cpp\nllm = llama_cpp.Llama(sys.argv[1], n_ctx=128, verbose=False)\n"
            "b = llm.moe_stats()['budget']\nprint(b['elastic'], b['budget_bytes'], llm.moe_load.options.verify)\n")
    env = cli_env(LLAMA_ARG_MOE_VERIFY="on")
    proc = cli("exec", "--moe-slots", 8, "--moe-budget", str(floor + 4096), "--",
               sys.executable, "-c", code, model, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", str(floor + 4096), "True"]
    # elastic: the controller starts (and may raise the budget to the capacity: plenty is free)
    proc = cli("exec", "--moe-slots", 8, "--moe-elastic", "on", "--", sys.executable, "-c", code, model,
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "True"


def test_exec_print_env():
    proc = cli("exec", "--moe-slots", "25%", "--print-env")
    assert proc.returncode == 0, proc.stderr
    assert "export EMPANEL_MOE_SLOTS=25%" in proc.stdout
    assert re.search(r"export LLAMA_CPP_LIB_PATH=\S+empanel_gguf/lib", proc.stdout)
    assert "_bootstrap" in proc.stdout


# ---------------------------------------------------------------------------------------------
# the memory guard


def test_estimate_counts_weights_pools_kv_and_compute(model):
    index = load_index(model)
    plan = plan_slots(index, 8)
    est = estimate.estimate(index, plan, n_ctx=512)
    assert est.weights == index.other_bytes_total
    assert est.experts == plan.pool_bytes
    # 3 layers x 2 KV heads x (16 + 16) dims x 2 bytes (F16) per token
    assert est.kv_per_token == 3 * 2 * 32 * 2
    assert est.kv == 512 * est.kv_per_token
    assert est.compute >= estimate.RUNTIME_BYTES
    assert est.total == est.weights + est.experts + est.kv + est.compute == est.host

    full = estimate.estimate(index, None, n_ctx=512)
    assert full.experts == index.expert_bytes_total
    assert estimate.estimate(index, plan, n_ctx=0).n_ctx == 512  # 0: the model's context
    q8 = estimate.estimate(index, plan, n_ctx=512, type_k=8, type_v=8)  # Q8_0 KV cache
    assert q8.kv < est.kv
    offloaded = estimate.estimate(index, plan, n_ctx=512, n_gpu_layers=-1, gpu_offload=True)
    assert offloaded.host == offloaded.compute


def test_estimate_mla(tmp_path):
    index = load_index(fixtures.write_fixture("deepseek2", tmp_path))
    shape = estimate.model_shape(index)
    assert shape.mla and shape.n_head_kv == 1
    assert (shape.head_k, shape.head_v) == (32 + 16, 32)  # kv_lora_rank + rope dims, kv_lora_rank


def test_check_refuses_with_advice_that_fits(model):
    index = load_index(model)
    plan = plan_slots(index, 16)
    est = estimate.estimate(index, plan, n_ctx=512)
    floor = 1 << 20
    # room for the pools of 10 slots, not 16
    per_slot = sum(layer.expert_bytes for layer in index.layers)
    available = est.host - est.experts + 10 * per_slot + floor
    with pytest.raises(guard.MemoryRefused) as err:
        guard.check(est, index, plan, available=available, floor=floor)
    text = str(err.value)
    assert "--force" in text and "--mem-floor" in text
    slots = int(re.search(r"--moe-slots (\d+) ", text).group(1))
    assert 10 <= slots < 16  # 10 at least: fewer slots also mean smaller micro-batches
    fits = estimate.estimate(index, plan_slots(index, slots), n_ctx=512)
    assert guard.check(fits, index, None, available=available, floor=floor) >= 0
    too_many = estimate.estimate(index, plan_slots(index, slots + 1), n_ctx=512)
    with pytest.raises(guard.MemoryRefused):
        guard.check(too_many, index, None, available=available, floor=floor)

    # a big context: the advice names a context size that fits
    big = estimate.estimate(index, plan_slots(index, 4), n_ctx=512 * 64)
    available = big.host - big.kv + 2048 * big.kv_per_token + floor
    with pytest.raises(guard.MemoryRefused, match=r"-c 2048 \(now 32768"):
        guard.check(big, index, None, available=available, floor=floor)
    assert guard.check(big, index, None, available=available, floor=floor, force=True) < 0
    assert guard.check(big, index, None, available=None, floor=floor) is None  # unknown: no guard


def test_plan_load_auto_slots(model):
    index = load_index(model)
    load = plan.plan_load(index, "auto", {"n_ctx": 512}, available=1 << 40, floor=0)
    assert load.moe_slots is None and load.plan is None and load.estimate.experts == index.expert_bytes_total
    assert load.requested == "auto" and load.available == 1 << 40 and load.floor == 0
    full = estimate.estimate(index, None, n_ctx=512)
    six = estimate.estimate(index, plan_slots(index, 6), n_ctx=512)
    load = plan.plan_load(index, "auto", {"n_ctx": 512}, available=six.host, floor=0)
    assert load.moe_slots == 6 and load.plan.min_slots == 6 and load.estimate.host == six.host < full.host
    assert any("6 of" in line for line in load.report())
    fewest = estimate.estimate(index, plan_slots(index, 4), n_ctx=512)
    with pytest.raises(guard.MemoryRefused, match="even the fewest slots"):
        plan.plan_load(index, "auto", {"n_ctx": 512}, available=fewest.host - 1, floor=0)


def test_parse_helpers(monkeypatch):
    assert host_memory.parse_floor("2GiB") == 2 << 30
    assert host_memory.parse_floor("0") == 0
    assert host_memory.parse_floor("10%", total=1000) == 100
    assert host_memory.parse_floor(None, total=100 << 30) == 5 << 30
    assert host_memory.parse_floor(None, total=4 << 30) == 1 << 30
    with pytest.raises(ValueError):
        host_memory.parse_floor("lots")
    assert [plan.parse_moe_slots(v) for v in ("none", "0", "auto", "8", "25%", None)] == \
        [None, None, "auto", 8, "25%", None]
    monkeypatch.setenv("EMPANEL_MEM_AVAILABLE", "3GiB")
    assert host_memory.available_memory() == 3 << 30
    monkeypatch.delenv("EMPANEL_MEM_AVAILABLE")
    if sys.platform.startswith("linux"):
        assert 0 < host_memory.available_memory() <= host_memory.total_memory()


def test_watchdog_trips_once_below_the_floor():
    values = iter([10, 9, 8, 3, 2, 1])
    calls = []
    dog = guard.Watchdog(5, lambda available, floor: calls.append((available, floor)),
                          interval=0.01, available_fn=lambda: next(values, 1))
    with dog:
        assert dog.tripped.wait(5)
        time.sleep(0.05)
    assert calls == [(3, 5)]
    assert "below the floor" in dog.message()
    idle = guard.Watchdog(0, None).start()  # floor 0: no thread at all
    assert idle._thread is None


def test_serve_without_the_server_extra_says_what_to_install(tmp_path):
    """A plain install lacks llama-cpp-python's [server] extra: serve names it, no traceback."""
    block = tmp_path / "block" / "uvicorn"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text("raise ImportError('No module named uvicorn (blocked for the test)')\n")
    env = child_env()
    env["PYTHONPATH"] = f"{tmp_path / 'block'}{os.pathsep}{env['PYTHONPATH']}"
    proc = subprocess.run([sys.executable, "-m", "empanel_gguf", "serve", "model.gguf"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "needs uvicorn" in proc.stderr and 'pip install "empanel-gguf[server]"' in proc.stderr
    assert "Traceback" not in proc.stderr


# llama.cpp's programs' command line, which needs no program built (tests/test_programs.py runs them)

def test_split_args_takes_only_exact_options():
    parser = programs_cmd.setup_arg_parser("llama-bench")
    ours, theirs = programs_cmd.split_args(parser, ["-ms", "25%", "-m", "a.gguf", "--moe-policy=lru", "-p", "64",
                                                "--moe-io-threads", "4", "-n", "16"])
    assert ours == ["-ms", "25%", "--moe-policy=lru", "--moe-io-threads", "4"]
    assert theirs == ["-m", "a.gguf", "-p", "64", "-n", "16"]
    flags = programs_cmd.program_flags(["-m", "a,b.gguf", "-c", "256", "--batch-size=64", "--lora", "x.gguf"])
    assert flags["model"] == ["a,b.gguf"] and flags["ctx"] == "256"  # a comma is a path's own
    assert flags["batch"] == "64" and flags["lora"] == ["x.gguf"]
    flags = programs_cmd.program_flags(["-m", "a.gguf,b.gguf", "-p", "512,1024", "-n", "128"], lists=True)
    assert flags["model"] == ["a.gguf", "b.gguf"] and flags["n_prompt"] == "512"  # llama-bench's lists
    # MTP drafting loads the MTP blocks: the plan pages them (issue 36)
    assert programs_cmd.program_flags(["-m", "a.gguf", "--spec-type", "ngram-cache,draft-mtp"])["spec_type"] == \
        "ngram-cache,draft-mtp"
    assert programs_cmd.program_flags(["--spec-type=draft-mtp"])["spec_type"] == "draft-mtp"



def test_missing_program_says_how_to_build(tmp_path):
    """The quick start builds no program: `empanel-gguf llama-bench` says how to build it."""
    from empanel_gguf.commands.options import BUILTIN_MODEL

    proc = subprocess.run([sys.executable, "-m", "empanel_gguf", "llama-bench", "-m", str(BUILTIN_MODEL)],
                          cwd=REPO, env=child_env(EMPANEL_GGUF_PROGRAMS_DIR=str(tmp_path / "none")),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "EMPANEL_PROGRAMS=ON" in proc.stderr and "Traceback" not in proc.stderr


def test_default_floor_scales_down_for_small_memories():
    """The memory guard's default floor: 1 GiB or 5 % of the memory from 4 GiB up, a quarter of
    a smaller one (a small cgroup limit keeps most of itself for the pools)."""
    from empanel_gguf.planning.host_memory import GiB, default_floor

    assert default_floor(64 * GiB) == int(0.05 * 64 * GiB)
    assert default_floor(8 * GiB) == GiB
    assert default_floor(4 * GiB) == GiB
    assert default_floor(int(1.6 * GiB)) == int(1.6 * GiB) // 4
    assert default_floor(512 << 20) == 128 << 20


def test_run_n_0_generates_nothing_and_s_minus_1_is_random(model):
    """llama.cpp's -n 0 evaluates the prompt and generates nothing (llama-cpp-python's max_tokens=0
    would run to the end of the context); -s -1 samples with a random seed, said on stderr."""
    from empanel_gguf.commands.run import resolve_seed

    prompt = "Hello the world, and this is a test"
    proc = cli("run", model, "-p", prompt, "-n", 0, "--moe-slots", 8)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == prompt + "\n"
    rep = report(proc)
    assert re.search(r"prompt +([2-9]|\d\d+) tokens in", rep), rep
    assert re.search(r"decode +0 tokens", rep), rep
    seeds = {resolve_seed(-1) for _ in range(4)}
    assert len(seeds) > 1 and all(0 <= s < 2**31 for s in seeds)
    assert resolve_seed(7) == 7
    proc = cli("run", model, "-p", "Hello", "-n", 2, "--moe-slots", 8)
    assert re.search(r"seed \d+ \(random: -s \d+ repeats this run\)", proc.stderr), proc.stderr


def test_run_help_explains_the_report():
    proc = cli("run", "--help")
    assert proc.returncode == 0, proc.stderr
    for term in ("hit rate", "bit for bit", "--no-repack", "recall", "dropped unread", "given back"):
        assert term in proc.stdout, term
