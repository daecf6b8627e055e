"""The planner's two figures (planning/estimate.py): what a load reserves and what becomes resident.

On a large vocabulary the two part: llama.cpp reserves its graph for a full micro-batch of logits
([151,936, 2,048] F32 is 1.16 GiB) and llama-cpp-python a scores array of n_batch rows, yet a call
that asks for one output touches one row of each. Pools are sized against the resident figure
under a cap, so it must hold what a run really touches: here within 10 % of the measured peak RSS
(VmHWM) on a model whose output dominates (2 tiny layers, Qwen3's 151,936 tokens), at n_ctx 4,096
and 32,768, with the defaults' micro-batch and llama-cpp-python's, and with logits_all.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from empanel_gguf.models import fixtures
from empanel_gguf.planning.estimate import estimate
from empanel_gguf.planning.index import load_index
from empanel_gguf.planning.options import moe_options
from empanel_gguf.planning.plan import plan_load

REPO = Path(__file__).resolve().parent.parent
GiB = 1 << 30

# tiny layers, a real vocabulary: the output matrix, the logits and the tokenizer's tables dominate
VOCAB_SPEC = fixtures.FixtureSpec("qwen3moe-vocab", "qwen3moe", n_layer=2, n_expert=64, n_expert_used=4,
                                  n_embd=256, n_ff_exp=128, weight_type="Q8_0", n_vocab=151936, seed=21)

# a prompt of n tokens, then 4 decoded; the peak RSS, and the estimate at the context reached
_PEAK_SCRIPT = """
import json, sys
from empanel_gguf import Llama
from empanel_gguf.planning.host_memory import proc_status
path, kwargs, n_prompt = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(path, n_threads=2, verbose=False, **kwargs)
text = llm.tokenize(b"the quick brown fox jumps over the lazy dog, and the cat sat on the mat.")
llm.eval((text * (n_prompt // len(text) + 1))[:n_prompt])
for _ in range(4):
    llm.eval([llm.sample(temp=0.0)])
load = llm.moe_load
at = load.estimate.at_context(llm.n_tokens)
print(json.dumps({"peak": proc_status()["VmHWM"], "resident": at.host, "bound": load.estimate.host,
                  "reserved": load.estimate.host_reserved, "n_ubatch": llm.context_params.n_ubatch,
                  "describe": at.describe()}))
"""


@pytest.fixture(scope="module")
def vocab_model(tmp_path_factory):
    return fixtures.write_model(VOCAB_SPEC, tmp_path_factory.mktemp("vocab") / "vocab.gguf")


def test_one_output_per_call_leaves_the_logits_reserved(vocab_model):
    """At one output per call the graph's [n_vocab, n_ubatch] logits and the n_batch-row scores
    array are address space only; logits_all makes them resident (a row per token evaluated)."""
    index = load_index(vocab_model)
    kwargs = dict(n_ctx=4096, n_batch=2048, n_ubatch=2048, flash_attn=True)
    one = estimate(index, None, **kwargs)
    row = 4 * 151936
    assert one.compute_reserved - one.compute >= row * (2048 + 2048 - 2)  # graph logits + scores
    every = estimate(index, None, **kwargs, logits_all=True)
    assert every.compute - one.compute >= row * (4096 + 2048 - 2)
    assert every.host_reserved >= every.host > one.host
    # the context reached only moves the attention scores (without flash attention) and logits_all's rows
    short = estimate(index, None, n_ctx=32768).at_context(300)
    assert short.compute < estimate(index, None, n_ctx=32768).compute
    assert short.kv == estimate(index, None, n_ctx=32768).kv  # llama.cpp clears all of it at load


def test_the_planner_sizes_pools_by_what_becomes_resident(vocab_model):
    """Under a cap the pools get what the logits leave: the reserved figure is hundreds of MiB
    above the resident one, and the slots follow the resident one."""
    index = load_index(vocab_model)
    kwargs = dict(n_ctx=4096, n_batch=512, n_ubatch=512, flash_attn=True)
    available = estimate(index, None, **kwargs).host - index.expert_bytes_total // 4  # 3/4 of the experts
    load = plan_load(index, "auto", {"n_ctx": 4096}, available=available, floor=0)
    assert load.micro_batch and load.plan is not None and not load.plan.holds_all
    assert load.estimate.host <= available < load.estimate.host_reserved
    assert load.plan.min_slots >= index.n_expert // 2


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.skipif(bool(os.environ.get("EMPANEL_SANITIZER")),
                    reason="a sanitizer's shadow memory and quarantine are in the RSS (scripts/sanitize.sh)")
@pytest.mark.parametrize("kwargs,n_prompt", [
    ({"n_ctx": 4096}, 3500),                                           # the defaults: 2,048-token calls, FA
    ({"n_ctx": 4096, "moe_batch": "stock"}, 3500),                     # llama-cpp-python's 512, no FA
    ({"n_ctx": 32768}, 3500),
    ({"n_ctx": 32768, "moe_batch": "stock"}, 3500),
    ({"n_ctx": 4096, "moe_batch": "stock", "logits_all": True}, 1200),  # every row of logits kept
])
def test_resident_estimate_within_ten_percent_of_peak_rss(vocab_model, kwargs, n_prompt):
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(vocab_model),
                           json.dumps({"moe_slots": "25%", **kwargs}), str(n_prompt)],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 2**20
    print(f"\n{kwargs}: peak RSS {got['peak'] / mib:.0f} MiB, resident estimate {got['resident'] / mib:.0f} MiB "
          f"(at n_ctx's end {got['bound'] / mib:.0f}, reserved {got['reserved'] / mib:.0f}): {got['describe']}")
    assert abs(got["resident"] - got["peak"]) <= 0.10 * got["peak"]
    assert got["bound"] >= got["resident"]  # the planner's figure: the end of the context
    assert got["reserved"] >= got["bound"]


def test_reserved_beyond_the_address_space_is_refused(vocab_model, tmp_path):
    """Where address space is limited (ulimit -v, strict overcommit) the reserved figure must fit
    it: llama.cpp would otherwise fail an allocation part way through the load."""
    from empanel_gguf.planning.guard import MemoryRefused
    from empanel_gguf.planning.host_memory import address_space_left

    index = load_index(vocab_model)
    kwargs = {"n_ctx": 4096}
    stock = moe_options(moe_batch="stock")
    fits = plan_load(index, "25%", kwargs, available=64 * GiB, floor=0, options=stock)
    with pytest.raises(MemoryRefused, match="address space"):
        plan_load(index, "25%", kwargs, available=64 * GiB, floor=0, address_space=fits.estimate.host_reserved - 1,
                  options=stock)
    # moe_batch "auto" takes a micro-batch whose graph fits instead of the 2,048 tokens'
    wide = plan_load(index, "25%", kwargs, available=64 * GiB, floor=0)
    assert wide.micro_batch["n_ubatch"] == 2048
    narrower = plan_load(index, "25%", kwargs, available=64 * GiB, floor=0,
                         address_space=wide.estimate.host_reserved - 1)
    assert narrower.micro_batch["n_ubatch"] < 2048
    assert narrower.estimate.host_reserved < wide.estimate.host_reserved
    # strict overcommit: CommitLimit less Committed_AS
    (tmp_path / "meminfo").write_text("MemTotal: 8000 kB\nCommitLimit:    3000 kB\nCommitted_AS:   1000 kB\n")
    (tmp_path / "overcommit").write_text("2\n")
    assert address_space_left(tmp_path / "meminfo", tmp_path / "overcommit") == 2000 * 1024
    (tmp_path / "overcommit").write_text("0\n")
    assert address_space_left(tmp_path / "meminfo", tmp_path / "overcommit") is None
    # ulimit -v, in a process of its own
    done = subprocess.run([sys.executable, "-c", "import resource; from empanel_gguf.planning.host_memory import "
                           "address_space_left, proc_status; size = proc_status()['VmSize']; "
                           "resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20), resource.RLIM_INFINITY)); "
                           "print(address_space_left())"],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert 0 < int(done.stdout) <= 64 << 20


def test_more_memory_never_plans_fewer_experts(vocab_model):
    """moe_batch "auto" is decided by what decode will read, not by what fits at the instant of the
    load: as the memory available grows, the experts the pools hold never fall by more than the
    decode noise the rule allows, and the micro-batch taken never costs more than that against
    llama-cpp-python's own (issue 62: 5.74 GiB free planned 15 slots, 4.82 GiB 22)."""
    from empanel_gguf.planning.guard import MemoryRefused
    from empanel_gguf.planning.plan import DECODE_NOISE

    index = load_index(vocab_model)
    # no experts at all beside the smallest compute buffer (512 tokens, flash attention)
    base = estimate(index, None, n_ctx=32768, n_batch=512, n_ubatch=512, flash_attn=True).host \
        - index.expert_bytes_total
    held = []
    for step in range(1, 12):
        available = base + step * index.expert_bytes_total // 12
        auto = plan_load(index, "auto", {"n_ctx": 32768}, available=available, floor=0)
        try:
            stock = plan_load(index, "auto", {"n_ctx": 32768}, available=available, floor=0,
                              options=moe_options(moe_batch="stock"))
        except MemoryRefused:  # llama-cpp-python's own micro-batch does not fit at all
            stock = None
        if stock is not None:
            slack = DECODE_NOISE * (index.expert_bytes_total - stock.estimate.experts)
            assert auto.estimate.experts >= stock.estimate.experts - slack, (available, auto.micro_batch)
        held.append(auto.estimate.experts)
    assert all(later >= earlier - DECODE_NOISE * index.expert_bytes_total for earlier, later in zip(held, held[1:]))
    assert held[-1] > held[0]


def test_a_micro_batch_that_holds_every_expert_is_taken(vocab_model):
    """Flash attention's compute buffer is smaller than llama-cpp-python's own at a long context:
    where only the larger micro-batch leaves room for every expert, it is taken (nothing pages);
    where no micro-batch fits, the guard refuses with stock's figures, or a forced load gets
    stock's micro-batch."""
    from empanel_gguf.planning.guard import MemoryRefused

    index = load_index(vocab_model)
    fa = estimate(index, None, n_ctx=32768, n_batch=2048, n_ubatch=2048, flash_attn=True).host
    assert estimate(index, None, n_ctx=32768).host > fa + (64 << 20)  # stock's KQ at n_ctx
    load = plan_load(index, "auto", {"n_ctx": 32768}, available=fa + (1 << 20), floor=0)
    assert load.plan is None and load.micro_batch == {"n_batch": 2048, "n_ubatch": 2048, "flash_attn": True}
    with pytest.raises(MemoryRefused, match="n_ctx 32768"):
        plan_load(index, "auto", {"n_ctx": 32768}, available=64 << 20, floor=0)
    forced = plan_load(index, "auto", {"n_ctx": 32768}, available=64 << 20, floor=0, force=True)
    assert forced.micro_batch == {} and forced.plan is not None
