"""A neighbour in a real memory cgroup: another process that takes memory while the model runs.
With moe_elastic the pools give memory back and nobody is killed; without, the kernel's OOM killer
fires in the same scenario (the control that shows the test bites). Tokens equal stock's.

Needs root and a memory cgroup (v1, or v2 with the memory controller delegated): skipped with
the reason elsewhere, failed with EMPANEL_REQUIRE_CGROUP=1 (CI)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.models.fixtures import FixtureSpec, write_model

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
PROMPT = b"The quick brown fox jumps over"
# 64 experts of 3 MiB (F16, 1024 x 512 x 3) in each of 2 layers: 384 MiB of experts
SPEC = FixtureSpec("neighbour", "qwen3moe", n_layer=2, n_expert=64, n_expert_used=4, n_embd=1024, n_ff_exp=512,
                   weight_type="F16", expert_types=("F16", "F16"), seed=21)
SLOTS = 48  # 288 MiB of pools, preloaded; the floor is 24 MiB
# the same in a layout ggml-cpu repacks (Q4_0, 1024 x 2048 x 3: 3.4 MiB an expert), the experts holes
# of zeros in a sparse file (quantizing 800 M random weights would take minutes): CPU_REPACK pools
REPACKED = FixtureSpec("neighbour-q4_0", "qwen3moe", n_layer=2, n_expert=64, n_expert_used=4, n_embd=1024,
                       n_ff_exp=2048, weight_type="F16", expert_types=("Q4_0", "Q4_0"), expert_holes=True, seed=21)

# the model's side of a scenario: step(n) decodes n greedy tokens of `llm` into `tokens`
STEP = """
import json, sys, time
import numpy as np
from empanel_gguf import Llama
tokens = []
def step(n):
    for _ in range(n):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(tokens[-1:])
"""

MODEL_SCRIPT = STEP + """
llm = Llama(sys.argv[1], n_ctx=128, logits_all=True, verbose=False, moe_slots=int(sys.argv[2]), moe_preload=True,
            moe_elastic=sys.argv[3] == "1", moe_repack=sys.argv[4:5] == ["1"])
llm.eval(llm.tokenize(%r))
step(4)
print("READY", flush=True)
sys.stdin.readline()          # the neighbour holds its memory now
step(12)
print("TOKENS", json.dumps(tokens, separators=(",", ":")), json.dumps(llm.moe_stats()["budget"]), flush=True)
sys.stdin.readline()          # the neighbour has left
t0 = time.monotonic()
while llm.moe_stats()["budget"]["budget_bytes"] < llm.moe_stats()["budget"]["capacity_bytes"] and time.monotonic() - t0 < 10:
    time.sleep(0.02)
print("BACK", time.monotonic() - t0, flush=True)
""" % PROMPT

NEIGHBOUR_SCRIPT = """
import mmap, sys
size = int(sys.argv[1])
m = mmap.mmap(-1, size)
for i in range(0, size, 4096):
    m[i] = 1
print("HELD", flush=True)
sys.stdin.readline()
"""


class Cgroup:
    """A memory cgroup of our own under this process's (v1, or v2 with memory delegated)."""

    def __init__(self, name):
        self.dir = None
        if os.geteuid() != 0:
            self._missing("not root: no cgroup of our own")
        entries = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
        v1 = [rel for _, controllers, rel in entries if "memory" in controllers.split(",")]
        if v1:
            self.version, base, rel = 1, Path("/sys/fs/cgroup/memory"), v1[0]
        else:
            self.version, base = 2, Path("/sys/fs/cgroup")
            rel = next((rel for hid, _, rel in entries if hid == "0"), "/")
            control = base / rel.lstrip("/") / "cgroup.subtree_control"
            if not control.exists() or "memory" not in control.read_text().split():
                self._missing("cgroup v2 without the memory controller delegated here")
        if not (base / rel.lstrip("/")).is_dir():
            self._missing(f"no memory cgroup directory for {rel}")
        self.dir = base / rel.lstrip("/") / f"{name}-{os.getpid()}"
        self.dir.mkdir()
        self.limit_file = self.dir / ("memory.limit_in_bytes" if self.version == 1 else "memory.max")
        self.usage_file = self.dir / ("memory.usage_in_bytes" if self.version == 1 else "memory.current")

    @staticmethod
    def _missing(why):
        if os.environ.get("EMPANEL_REQUIRE_CGROUP") == "1":
            pytest.fail(f"EMPANEL_REQUIRE_CGROUP=1 but {why}", pytrace=False)
        pytest.skip(why)

    def set_limit(self, n):
        self.limit_file.write_text(str(n))

    def usage(self):
        return int(self.usage_file.read_text())

    def oom_kills(self):
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in (self.dir / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def spawn(self, args):
        procs = self.dir / "cgroup.procs"
        return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO, preexec_fn=lambda: procs.write_text(str(os.getpid())))

    def remove(self):
        if self.dir is not None:
            for _ in range(50):
                try:
                    self.dir.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


def expect(proc, word, timeout=120):
    """The line that starts with `word`, or None if the process ended first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        line = proc.stdout.readline()
        if not line:
            return None
        if line.startswith(word):
            return line.split(maxsplit=1)[1] if " " in line.strip() else ""
    return None


def tell(proc):
    """A line to a process's stdin, if it still reads (the OOM killer may have taken it)."""
    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
    except (BrokenPipeError, OSError):
        pass


def decode_on(model):
    """The model told to decode on, if it lives: (tokens, budget figures), or (None, None)."""
    if model.poll() is not None:
        return None, None
    tell(model)
    got = expect(model, "TOKENS")
    if got is None:
        return None, None
    text_tokens, text_budget = got.split(" ", 1)
    return json.loads(text_tokens), json.loads(text_budget)


def run_scenario(cgroup, path, elastic, limit_at_load=True, repack=False):
    """The model in the cgroup, the limit lowered to what it uses plus 448 MiB (1.75 of the
    controller's 256 MiB reserve: a band where it rests), a neighbour that takes 528 MiB mid-decode,
    then leaves. (tokens or None, budget figures, seconds back, killed)"""
    if limit_at_load:
        cgroup.set_limit(2 << 30)
    model = cgroup.spawn([sys.executable, "-c", MODEL_SCRIPT, str(path), str(SLOTS), "1" if elastic else "0",
                          "1" if repack else "0"])
    neighbour = None
    try:
        assert expect(model, "READY") is not None, model.stderr.read()[-3000:]
        cgroup.set_limit(cgroup.usage() + 448 * MiB)
        neighbour = cgroup.spawn([sys.executable, "-c", NEIGHBOUR_SCRIPT, str(528 * MiB)])
        expect(neighbour, "HELD", timeout=60)  # (None where the OOM killer took it)
        back = None
        tokens, budget = decode_on(model)
        tell(neighbour)
        neighbour.wait(timeout=30)
        if tokens is not None and model.poll() is None:
            tell(model)
            got = expect(model, "BACK")
            back = float(got) if got is not None else None
        model.wait(timeout=60)
        return tokens, budget, back, cgroup.oom_kills(), (model.returncode, neighbour.returncode)
    finally:
        for proc in (model, neighbour):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def stock_tokens(path, n=16, n_ctx=128):
    llm = Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False)
    try:
        llm.eval(llm.tokenize(PROMPT))
        tokens = []
        for _ in range(n):
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(tokens[-1:])
        return tokens
    finally:
        llm.close()


@pytest.mark.parametrize("repack", [False, True], ids=["plain", "repacked"])
def test_a_neighbour_kills_nobody_where_pools_give_back(tmp_path, repack):
    """Plain pools (exact to --no-repack) and CPU_REPACK ones (exact to stock's defaults, which the
    stock run here has) alike."""
    path = write_model(REPACKED if repack else SPEC, tmp_path / "neighbour.gguf")
    cgroup = Cgroup("empanel-neighbour")
    try:
        tokens, budget, back, kills, codes = run_scenario(cgroup, path, elastic=True, repack=repack)
        assert kills == 0 and codes == (0, 0), (kills, codes)
        assert tokens == stock_tokens(path)
        assert budget["n_shrinks"] >= 1 and budget["given_back_bytes"] >= 200 * MiB, budget
        assert budget["max_shrink_ms"] < 100, budget
        assert back is not None and back < 5, back
    finally:
        cgroup.remove()
    if repack:
        return  # (the control below shows the scenario bites; once is enough)
    control = Cgroup("empanel-neighbour-control")
    try:  # the same without moe_elastic: the OOM killer fires (the scenario bites)
        tokens, budget, back, kills, codes = run_scenario(control, path, elastic=False)
        assert kills >= 1 and -9 in codes, (kills, codes)
    finally:
        control.remove()


def test_a_limit_set_after_the_load_is_watched(tmp_path):
    """A cgroup with no limit when the model loads, one set mid-decode (`docker update`,
    `systemctl set-property ... MemoryMax=`), then a neighbour: the controller reads the limit
    at its next poll (the plan names every cgroup around the model, limited or not: 63-2), gives
    back, nobody is killed, tokens equal stock's."""
    path = write_model(SPEC, tmp_path / "neighbour.gguf")
    cgroup = Cgroup("empanel-limit-later")
    try:
        tokens, budget, back, kills, codes = run_scenario(cgroup, path, elastic=True, limit_at_load=False)
        assert kills == 0 and codes == (0, 0), (kills, codes)
        assert tokens == stock_tokens(path)
        assert budget["n_shrinks"] >= 1 and budget["given_back_bytes"] >= 200 * MiB, budget
    finally:
        cgroup.remove()


LOWERED_SCRIPT = MODEL_SCRIPT.split('print("READY"')[0] + """
print("READY", flush=True)
sys.stdin.readline()          # the limit is lowered now
step(12)
print("TOKENS", json.dumps(tokens, separators=(",", ":")), json.dumps(llm.moe_stats()["budget"]), flush=True)
"""


def lower_limit(cgroup, limit, seconds):
    """Write `limit` every 20 ms, as an admin's retrying tool would, until it is taken or `seconds`
    pass: (seconds it took, or None, refusals)."""
    t0, refused = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        try:
            cgroup.set_limit(limit)
            return time.monotonic() - t0, refused
        except OSError:
            refused += 1
            time.sleep(0.02)
    return None, refused


def run_lowered(cgroup, path, elastic):
    """The model decoding in a cgroup with room to spare, the limit written down to 160 MiB under
    what the group holds: (seconds until taken or None, refusals, tokens, budget, kills, codes)."""
    cgroup.set_limit(2 << 30)
    model = cgroup.spawn([sys.executable, "-c", LOWERED_SCRIPT, str(path), str(SLOTS), "1" if elastic else "0"])
    try:
        assert expect(model, "READY") is not None, model.stderr.read()[-3000:]
        taken, refused = lower_limit(cgroup, cgroup.usage() - 160 * MiB, 2.0)
        tokens, budget = decode_on(model)
        model.wait(timeout=60)
        return taken, refused, tokens, budget, cgroup.oom_kills(), model.returncode
    finally:
        if model.poll() is None:
            model.kill()
            model.wait()


def test_a_limit_lowered_mid_decode_goes_through(tmp_path):
    """The limit written below what the group holds while the model decodes: cgroup v1 refuses the
    write until the group gives back (v2 would reclaim, then OOM-kill). The controller hears the
    kernel's reclaim (memory.pressure_level) and gives back, so a retrying writer's limit is taken
    within 1 s; the model lives on, tokens equal stock's. Without moe_elastic the write is refused
    for as long as it is tried (the scenario bites)."""
    path = write_model(SPEC, tmp_path / "neighbour.gguf")
    cgroup = Cgroup("empanel-lowered")
    try:
        if cgroup.version != 1:
            pytest.skip("cgroup v2 takes a lowered limit at once (memory.max), then reclaims or OOM-kills")
        taken, refused, tokens, budget, kills, code = run_lowered(cgroup, path, elastic=True)
        assert taken is not None and taken < 1.0, (taken, refused, budget)
        assert kills == 0 and code == 0, (kills, code)
        assert budget["hears_kernel"] and budget["n_events"] >= 1 and budget["n_shrinks"] >= 1, budget
        assert tokens == stock_tokens(path)
    finally:
        cgroup.remove()
    control = Cgroup("empanel-lowered-control")
    try:
        taken, refused, tokens, budget, kills, code = run_lowered(control, path, elastic=False)
        assert taken is None and refused >= 10, (taken, refused)
    finally:
        control.remove()


AT_LOAD_SCRIPT = STEP + """
llm = Llama(sys.argv[1], n_ctx=256, logits_all=True, verbose=False, moe_slots="auto")
at_load = llm.moe_stats()["budget"]
llm.eval(llm.tokenize(%r))
step(4)
print("LOADED", json.dumps(at_load), flush=True)
sys.stdin.readline()          # the neighbour has left: decode on until the budget has grown
t0 = time.monotonic()
target = min(at_load["budget_bytes"] + %d, at_load["capacity_bytes"])  # (the capacity may be closer)
while llm.moe_stats()["budget"]["budget_bytes"] < target and time.monotonic() - t0 < 10:
    step(1) if len(tokens) < 100 else time.sleep(0.02)  # (a move up waits for the slots promised to fill)
grew = time.monotonic() - t0
step(8)
print("TOKENS", grew, json.dumps(tokens, separators=(",", ":")), json.dumps(llm.moe_stats()["budget"]), flush=True)
""" % (PROMPT, 64 * MiB)


def test_pools_planned_around_a_neighbour_grow_once_it_leaves(tmp_path):
    """A neighbour that holds memory when the model loads: moe_slots="auto" plans a capacity for
    the whole limit and starts its live budget at what is free; once the neighbour leaves the
    budget grows past that (within 5 s) and the pools fill it. Nobody is killed, tokens equal
    stock's."""
    path = write_model(SPEC, tmp_path / "neighbour.gguf")
    cgroup = Cgroup("empanel-at-load")
    model = neighbour = None
    try:
        cgroup.set_limit(768 * MiB)
        neighbour = cgroup.spawn([sys.executable, "-c", NEIGHBOUR_SCRIPT, str(256 * MiB)])
        assert expect(neighbour, "HELD", timeout=60) is not None
        env = {k: v for k, v in os.environ.items() if k != "EMPANEL_MEM_AVAILABLE"}
        procs = cgroup.dir / "cgroup.procs"
        model = subprocess.Popen([sys.executable, "-c", AT_LOAD_SCRIPT, str(path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                                 preexec_fn=lambda: procs.write_text(str(os.getpid())))
        got = expect(model, "LOADED")
        assert got is not None, model.stderr.read()[-3000:]
        at_load = json.loads(got)
        assert at_load["elastic"] and at_load["budget_bytes"] < at_load["capacity_bytes"], at_load
        tell(neighbour)
        neighbour.wait(timeout=30)
        tell(model)
        got = expect(model, "TOKENS")
        assert got is not None, model.stderr.read()[-3000:]
        model.wait(timeout=60)
        grew, text_tokens, text_budget = got.split(" ", 2)
        budget = json.loads(text_budget)
        # 64 MiB more, or up to the capacity where that is closer (more was free at load on a
        # machine whose processes took less): still a move of at least 32 MiB
        grow = min(64 * MiB, at_load["capacity_bytes"] - at_load["budget_bytes"])
        assert grow >= 32 * MiB, at_load
        assert float(grew) < 5 and budget["budget_bytes"] >= at_load["budget_bytes"] + grow, (grew, at_load, budget)
        assert budget["resident_bytes"] > at_load["budget_bytes"], budget  # filled past the budget at load
        assert cgroup.oom_kills() == 0 and (model.returncode, neighbour.returncode) == (0, 0)
        tokens = json.loads(text_tokens)
        # (a slow machine decodes up to 100 tokens before the budget has grown: stock's context
        # is the model's 256, not the 128 of the other tests)
        assert tokens == stock_tokens(path, len(tokens), n_ctx=256)
    finally:
        for proc in (model, neighbour):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        cgroup.remove()
