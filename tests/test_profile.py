"""Calibration profiles and the warm start (planning/profile.py, empanel-gguf calibrate, moe_profile)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.commands.options import BUILTIN_MODEL
from empanel_gguf.lab.exactness import greedy_logits
from empanel_gguf.planning.index import load_index
from empanel_gguf.commands.calibrate import calibrate
from empanel_gguf.planning.profile import ProfileError, default_path, load_profile, resolve, save_profile

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMPANEL_PROFILE_DIR", str(tmp_path / "profiles"))  # a cache of each test's own


@pytest.fixture(scope="module")
def builtin_profile(tmp_path_factory):
    if not BUILTIN_MODEL.is_file():
        pytest.skip("the built-in model is not in this checkout")
    return save_profile(calibrate(BUILTIN_MODEL), tmp_path_factory.mktemp("profile") / "builtin.json")


def test_profile_round_trips_and_orders_by_use(builtin_profile):
    index = load_index(BUILTIN_MODEL)
    profile = load_profile(builtin_profile, index)
    assert profile.moe_layers == index.moe_layers and profile.counts.shape == (len(index.layers), index.n_expert)
    # every routed token counted once per layer: tokens x top-k
    assert (profile.counts.sum(axis=1) == profile.tokens * index.n_expert_used).all()
    order = profile.order(index.moe_layers[0])
    row = profile.counts[0]
    assert sorted(order) == list(range(index.n_expert)) and row[order[0]] == row.max()
    again = save_profile(profile, builtin_profile.with_name("again.json"))
    assert json.loads(again.read_text()) == json.loads(Path(builtin_profile).read_text())


def test_profile_of_another_file_is_refused(builtin_profile, tmp_path):
    other = fixtures.write_fixture("qwen3moe-q4_k", tmp_path)
    with pytest.raises(ProfileError, match="not of qwen3moe-q4_k.gguf.*calibrate this model"):
        load_profile(builtin_profile, load_index(other))
    with pytest.raises(ProfileError):  # the Llama argument says the same, before anything loads
        Llama(str(other), moe_slots=4, moe_profile=str(builtin_profile), verbose=False)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(ProfileError, match="not a readable profile"):
        load_profile(garbage, load_index(other))


def test_auto_finds_the_cached_profile(tmp_path):
    path = fixtures.write_fixture("qwen3moe-f32", tmp_path)
    index = load_index(path)
    assert resolve(index, "auto") == (None, None)  # nothing cached: cold
    saved = save_profile(calibrate(path, n_tokens=64), default_path(index))
    profile, where = resolve(index, "auto")
    assert where == saved and profile.tokens == 64
    llm = Llama(str(path), moe_slots=4, n_ctx=128, verbose=False)  # moe_profile="auto"
    try:  # warm start: the pools are filled at load with each layer's most used experts
        stats = llm.moe_stats()
        assert stats["total"]["preloaded"] == 4 * len(index.layers)
        first = index.moe_layers[0]
        assert set(llm._experts.slot_table(first)) == set(profile.order(first)[:4])
    finally:
        llm.close()


def test_profile_changes_no_output(tmp_path):
    path = fixtures.write_fixture("qwen3moe-q4_k", tmp_path)
    profile = save_profile(calibrate(path, n_tokens=64), tmp_path / "p.json")
    runs = []
    # stock in the layout 4 paged slots choose (moe_repack auto: --no-repack)
    for moe in ({"moe_slots": None, "moe_repack": False}, {"moe_slots": 4, "moe_profile": None}, {"moe_slots": 4, "moe_profile": str(profile)}):
        llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, **moe)
        try:
            runs.append(greedy_logits(llm, llm.tokenize(b"The quick brown fox jumps over the lazy dog"), 8))
        finally:
            llm.close()
    for logits, tokens in runs[1:]:
        assert tokens == runs[0][1] and np.array_equal(logits, runs[0][0])


def test_profile_warm_start_hits_more_than_cold(builtin_profile):
    import warm_start

    rows = warm_start.compare(BUILTIN_MODEL, "25%", 64, builtin_profile)
    print("\n" + "\n".join(f"{arm}: {100 * r[0]:.1f}% ({r[1]} hits, {r[2]} misses)" for arm, r in rows.items()))
    assert rows["profile"][0] > rows["cold"][0]
    assert rows["cold"][3] == 0 and rows["profile"][3] > 0


def test_calibrate_command(tmp_path, capsys):
    from empanel_gguf.cli import main

    path = fixtures.write_fixture("qwen3moe-f32", tmp_path)
    assert main(["calibrate", str(path), "-n", "32", "-o", str(tmp_path / "c.json")]) == 0
    assert "32 tokens" in capsys.readouterr().out
    assert load_profile(tmp_path / "c.json", load_index(path)).tokens == 32
    assert main(["calibrate", str(tmp_path / "missing.gguf")]) == 1


def test_a_damaged_cached_profile_is_reported_and_ignored(tmp_path, capfd):
    """moe_profile="auto" meets a cached profile that does not parse: one line on stderr whatever
    verbose is, the load goes on cold (nothing preloaded), and `run` says it too."""
    path = fixtures.write_fixture("qwen3moe-f32", tmp_path)
    cached = default_path(load_index(path))
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text('{"format": "empanel-gguf-profile", "version": 1, "counts": [[1, 2')  # cut short
    capfd.readouterr()
    llm = Llama(str(path), moe_slots=4, n_ctx=128, verbose=False)
    try:
        err = capfd.readouterr().err
        lines = [line for line in err.splitlines() if "warm start" in line]
        assert len(lines) == 1 and "not a readable profile" in lines[0] and "starting cold" in lines[0], err
        assert llm.moe_stats()["total"]["preloaded"] == 0
    finally:
        llm.close()
    from empanel_gguf.cli import main

    assert main(["run", str(path), "-p", "Hello", "-n", "2", "--moe-slots", "4"]) == 0
    assert "warm start" in capfd.readouterr().err


# moe_policy="auto": calibrate's policy ranking, used at plan time


def test_calibrate_ranks_the_engine_policies(builtin_profile):
    from empanel_gguf.abi.header import ENGINE_POLICIES

    index = load_index(BUILTIN_MODEL)
    profile = load_profile(builtin_profile, index)
    ranking = profile.policies
    assert ranking["slots"] == sorted(ranking["slots"]) and ranking["slots"][0] == index.n_expert_used
    assert set(ranking["hit_rate"]) == set(ENGINE_POLICIES)
    for row in ranking["hit_rate"].values():
        assert len(row) == len(ranking["slots"]) and all(0 < r < 1 for r in row)
        assert row == sorted(row)  # more slots, more hits, for every policy


def _shifting_records(index, n_tokens=600):
    """Routing whose hot set moves halfway: the first half uses experts 0..7, the second 8..15,
    each token k of its half's 8 (every MoE layer the same). Recency wins; counts lag."""
    k = index.n_expert_used
    rng = np.random.default_rng(0)
    out = []
    for t in range(n_tokens):
        hot = np.arange(8) + (0 if t < n_tokens // 2 else 8)
        ids = rng.choice(hot, size=k, replace=False)
        for il in index.moe_layers:
            out += [il, 1, k, *ids.tolist()]
    return [np.asarray(out, dtype=np.int32)]


def test_auto_takes_the_policy_the_replay_ranks_best(tmp_path):
    from empanel_gguf.commands.calibrate import rank_policies
    from empanel_gguf.planning.cache import file_identity
    from empanel_gguf.planning.plan import moe_options, plan_load
    from empanel_gguf.planning.profile import Profile

    index = load_index(BUILTIN_MODEL)
    ranking = rank_policies(index, _shifting_records(index))
    at = ranking["slots"].index(8)
    lru, lfu = ranking["hit_rate"]["lru"][at], ranking["hit_rate"]["lfu-decay"][at]
    assert lru > lfu  # the traces choose other than the default
    profile = Profile(model=file_identity(index), n_expert=index.n_expert, n_expert_used=index.n_expert_used,
                      moe_layers=index.moe_layers, tokens=600,
                      counts=np.ones((len(index.moe_layers), index.n_expert), dtype=np.int64), policies=ranking)
    path = save_profile(profile, tmp_path / "shift.json")
    load = plan_load(index, 8, options=moe_options(moe_profile=str(path)))
    assert load.options.policy == "lru" or load.options.policy == "g-lru"
    assert load.options.policy == max(ranking["hit_rate"], key=lambda p: ranking["hit_rate"][p][at])
    assert any(n.startswith("moe-policy auto: ") for n in load.notes)
    # without a profile: the default, said so; an explicit policy is kept
    plain = plan_load(index, 8, options=moe_options(moe_profile=None))
    assert plain.options.policy == "lfu-decay" and any("no calibrated policy ranking" in n for n in plain.notes)
    assert plan_load(index, 8, options=moe_options(moe_policy="lfu-decay", moe_profile=str(path))).options.policy == "lfu-decay"
    # and the load runs it: Llama names the policy it took
    llm = Llama(str(BUILTIN_MODEL), moe_slots=8, moe_profile=str(path), n_ctx=64, verbose=False)
    try:
        assert llm.moe_policy == load.options.policy
    finally:
        llm.close()


def test_a_malformed_policy_ranking_is_refused(builtin_profile, tmp_path):
    data = json.loads(Path(builtin_profile).read_text())
    data["policies"] = {"slots": [4, 8], "hit_rate": {"lru": [0.5]}}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="policy ranking"):
        load_profile(bad, load_index(BUILTIN_MODEL))


@pytest.mark.parametrize("chosen, planned", [("lru", ["lfu-decay"]), ("g-lru", ["lfu-decay", "g-lru"])])
def test_auto_policy_plans_the_slots_once(tmp_path, monkeypatch, chosen, planned):
    """moe_policy="auto" plans the slots once, under the default policy, to choose; and again only
    where the chosen policy sizes its pools otherwise (g-lru): the plan is the one the chosen
    policy makes from the start."""
    from empanel_gguf.abi.header import ENGINE_POLICIES
    from empanel_gguf.planning import plan
    from empanel_gguf.planning.cache import file_identity
    from empanel_gguf.planning.profile import Profile

    index = load_index(BUILTIN_MODEL)
    ranking = {"slots": [8], "hit_rate": {p: [0.9 if p == chosen else 0.5] for p in ENGINE_POLICIES}}
    profile = Profile(model=file_identity(index), n_expert=index.n_expert, n_expert_used=index.n_expert_used,
                      moe_layers=index.moe_layers, tokens=600,
                      counts=np.ones((len(index.moe_layers), index.n_expert), dtype=np.int64), policies=ranking)
    path = save_profile(profile, tmp_path / f"{chosen}.json")
    real, calls = plan.plan_slots, []
    monkeypatch.setattr(plan, "plan_slots", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    load = plan.plan_load(index, 8, options=plan.moe_options(moe_profile=str(path)), guard=False)
    assert load.options.policy == chosen and calls == planned
    alone = real(index, 8, chosen)
    assert (load.plan.n_slots, load.plan.budget_bytes, load.plan.pool_bytes) == (
        alone.n_slots, alone.budget_bytes, alone.pool_bytes)
