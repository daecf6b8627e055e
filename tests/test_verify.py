"""Verified expert reads (moe_verify): `empanel-gguf verify` saves every expert's XXH3-64 digest;
a load with moe_verify=True checks each expert it reads against them (or against its first
read), with outputs unchanged, and a file whose experts changed before the load fails the decode
that reads them."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from empanel_gguf import Llama, MoeReadError
from empanel_gguf.planning import digests
from empanel_gguf.models import fixtures
from empanel_gguf.commands import verify
from empanel_gguf.lab.exactness import greedy_logits
from empanel_gguf.planning.index import load_index

KW = dict(n_ctx=256, n_threads=2, logits_all=True, seed=0, verbose=False)
PROMPT = b"Hello the world, and this is a test of verified reads"


@pytest.fixture(scope="module", params=["qwen3moe-f32", "qwen3moe-q4_0"])
def model(request, tmp_path_factory):
    """A private copy (the tests change its bytes) and its reference logits without slots."""
    src = fixtures.write_fixture(request.param, tmp_path_factory.mktemp("verify-src"))
    path = tmp_path_factory.mktemp("verify") / src.name
    shutil.copy(src, path)
    llm = Llama(str(path), **KW)
    ref, _ = greedy_logits(llm, PROMPT, n_greedy=8)
    llm.close()
    return path, ref


def _corrupt_expert(path, layer=0, kind="down", expert=1):
    """Other bytes for one expert, same size, the mtime put back."""
    st = path.stat()
    t = load_index(path).layers[layer].tensors[kind]
    with open(path, "r+b") as f:
        f.seek(t.offset + expert * t.stride)
        f.write(os.urandom(t.stride))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return t.name


@pytest.mark.usefixtures("read_io")  # on both read paths
def test_verified_reads_leave_the_outputs_unchanged(model, capfd):
    path, ref = model
    assert verify.main([str(path), "--force"]) == 0
    assert "saved the digests" in capfd.readouterr().out
    for moe_slots in (4, "25%"):
        llm = Llama(str(path), moe_slots=moe_slots, moe_verify=True, **dict(KW, verbose=True))
        try:
            got, _ = greedy_logits(llm, PROMPT, n_greedy=8)
            total = llm.moe_stats()["total"]
        finally:
            llm.close()
        assert np.array_equal(got, ref)
        n_tensors = len(load_index(path).layers[0].tensors)
        # every expert tensor that landed: read-ahead dropped before an expert landed whole is not
        read = total["misses"] + total["preloaded"] + total["prefetched"]
        assert (read - total["prefetch_dropped"]) * n_tensors <= total["verified"] <= read * n_tensors, total
        assert total["verified"] > 0
        assert total["verify_s"] > 0
    assert "checked against the digests in" in capfd.readouterr().err


def test_first_read_digests_without_a_verify_pass(model, tmp_path, monkeypatch, capfd):
    path, ref = model
    monkeypatch.setenv("EMPANEL_PROFILE_DIR", str(tmp_path / "empty-cache"))
    llm = Llama(str(path), moe_slots=4, moe_verify=True, **dict(KW, verbose=True))
    try:
        got, _ = greedy_logits(llm, PROMPT, n_greedy=8)
        assert llm.moe_stats()["total"]["verified"] > 0
    finally:
        llm.close()
    assert np.array_equal(got, ref)
    assert "first read gives its digest" in capfd.readouterr().err


@pytest.mark.usefixtures("read_io")  # on both read paths
def test_experts_changed_before_the_load_fail_the_decode(model, tmp_path):
    path, ref = model
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    assert verify.main([str(copy), "--force"]) == 0
    name = _corrupt_expert(copy)
    # the identity (size, header) is unchanged: the saved digests still apply, and catch it
    assert verify.main([str(copy)]) == 1
    unverified = Llama(str(copy), moe_slots=16, moe_preload=True, **KW)  # every expert read: silently wrong
    try:
        got, _ = greedy_logits(unverified, PROMPT)
    finally:
        unverified.close()
    assert not np.array_equal(got, ref[: len(got)])
    llm = Llama(str(copy), moe_slots=4, moe_verify=True, **KW)
    try:
        with pytest.raises(MoeReadError, match=rf"{name}: expert 1 .* does not match its digest"):
            for token in llm.tokenize(PROMPT):
                llm.eval([token])
    finally:
        llm.close()


def test_verify_command_lists_changed_experts(model, tmp_path, capfd):
    path, _ = model
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    out = tmp_path / "digests.json"
    assert verify.main([str(copy), "-o", str(out)]) == 0
    assert digests.load(load_index(copy), out) is not None
    name = _corrupt_expert(copy, layer=1, kind="up", expert=3)
    capfd.readouterr()
    assert verify.main([str(copy), "-o", str(out)]) == 1
    assert f"CHANGED  {name} expert 3" in capfd.readouterr().out


def test_a_damaged_digest_file_refuses_the_load_naming_verify(tmp_path, monkeypatch):
    """Saved digests that do not parse never let a verifying load go on unchecked: ValueError,
    saying how to make them anew."""
    monkeypatch.setenv("EMPANEL_PROFILE_DIR", str(tmp_path / "cache"))  # this test's own cache
    path = fixtures.write_fixture("qwen3moe-f32", tmp_path)
    saved = digests.default_path(load_index(path))
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text("{not json")
    with pytest.raises(ValueError, match=r"moe_verify: .*not a readable digest file.*empanel-gguf verify --force"):
        Llama(str(path), moe_slots=4, moe_verify=True, **KW)
