"""Threads: two contexts on one model's slot pools decoding at once, and loads in two threads.

A program using llama.cpp's C API may make a second context on a loaded model
(llama_init_from_model, as llama-cpp-python's LlamaContext does; llama-server's MTP drafting does
so on the target model) and decode on both from two threads. The contexts share the model's pools:
every test here runs both at once (ctypes releases the GIL inside llama_decode) and compares each
context's logits, bit for bit, with stock llama.cpp decoding the same tokens alone.
"""

import threading

import numpy as np
import pytest

from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.llama import model_params
from empanel_gguf.engine.native import use_our_libraries

llama_cpp = use_our_libraries()

NAME = "qwen3moe-f32"  # 16 experts, top-4: 4 slots hold one token's experts, so tokens miss


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return fixtures.write_fixture(NAME, tmp_path_factory.mktemp("threads"))


class Context:
    """A llama_context of its own on a loaded model, decoding one sequence."""

    def __init__(self, model, n_batch, n_ctx=256):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_threads = params.n_threads_batch = 1
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        assert self.ctx, "llama_init_from_model failed"
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.pos = 0

    def decode(self, tokens):
        """Decode tokens in one llama_decode; returns the logits of each [len(tokens), n_vocab]."""
        b = self.batch
        b.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = self.pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self.pos += len(tokens)
        rows = [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                for i in range(len(tokens))]
        return np.array(rows, copy=True)

    def run(self, pieces):
        """Decode each piece (a list of token ids) in turn; all logits [n_tokens, n_vocab]."""
        return np.concatenate([self.decode(piece) for piece in pieces])

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


def token_pieces(seed, n_prompt, n_decode, n_vocab):
    """A prompt of n_prompt random token ids (one piece, or none), then n_decode single tokens."""
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(1, n_vocab, size=n_prompt + n_decode)]
    return ([ids[:n_prompt]] if n_prompt else []) + [[t] for t in ids[n_prompt:]]


def stock_logits(path, work, n_batch):
    """Stock llama.cpp (every expert resident) decoding each work item alone, in one context each."""
    llm = Llama(str(path), n_ctx=64, verbose=False)
    try:
        out = []
        for pieces in work:
            ctx = Context(llm._model.model, n_batch)
            try:
                out.append(ctx.run(pieces))
            finally:
                ctx.close()
        return out
    finally:
        llm.close()


def run_at_once(model, work, n_batch):
    """Each work item on its own context and thread, all started together; their logits."""
    contexts = [Context(model, n_batch) for _ in work]
    start = threading.Barrier(len(work))
    results = [None] * len(work)
    errors = []

    def worker(i):
        try:
            start.wait()
            results[i] = contexts[i].run(work[i])
        except Exception as e:  # noqa: BLE001 - reported below, with the thread that raised it
            errors.append(f"context {i}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for ctx in contexts:
        ctx.close()
    assert not any(t.is_alive() for t in threads), "a decoding thread hung"
    assert not errors, errors
    return results


@pytest.mark.parametrize("options", [
    dict(),                                   # overlapped reads, the gate-ahead guess
    dict(moe_prefetch=2, moe_policy="lru"),   # read-ahead two layers deep, its drops
    dict(moe_io_threads=0, moe_guess=False),  # the decoding thread reads alone
], ids=["default", "read-ahead", "no-readers"])
def test_two_contexts_decoding_on_two_threads_match_stock(model_path, options):
    """Two contexts on one model with 4 slots of 16 experts, each decoding its own 48 tokens one at
    a time on its own thread: both give stock's logits, and the tokens miss."""
    llm = Llama(str(model_path), moe_slots=4, n_ctx=64, verbose=False, **options)
    try:
        n_vocab = llm.n_vocab()
        work = [token_pieces(seed, 0, 48, n_vocab) for seed in (1, 2)]
        expected = stock_logits(model_path, work, n_batch=8)
        for attempt in range(2):  # a race shows in some runs only: two rounds
            llm._experts.reset_stats()
            got = run_at_once(llm._model.model, work, n_batch=8)
            for i in range(len(work)):
                assert np.array_equal(got[i], expected[i]), f"round {attempt}: context {i}'s logits differ from stock's"
            total = llm.moe_stats()["total"]
            assert total["misses"] >= 48, total  # misses on (nearly) every token of both contexts
    finally:
        llm.close()


def test_two_contexts_with_prompts_in_waves_match_stock(model_path):
    """Two 100-token prompts at once on two contexts over 4 slots: each micro-batch routes to every
    expert, so it runs in waves; then 8 tokens each. Both give stock's logits at the same
    micro-batch size."""
    llm = Llama(str(model_path), moe_slots=4, n_ctx=64, verbose=False)
    try:
        n_vocab = llm.n_vocab()
        work = [token_pieces(seed, 100, 8, n_vocab) for seed in (3, 4)]
        expected = stock_logits(model_path, work, n_batch=128)
        got = run_at_once(llm._model.model, work, n_batch=128)
        for i in range(len(work)):
            assert np.array_equal(got[i], expected[i]), f"context {i}'s logits differ from stock's"
        layers = llm.moe_stats()["layers"]
        assert all(layer["n_waves"] > layer["n_remaps"] for layer in layers.values()), layers
    finally:
        llm.close()


def test_context_of_llama_and_a_second_one_interleave_on_two_threads(model_path):
    """The Llama's own context (llama-cpp-python's eval) and a second one on the same model, on two
    threads: the Llama's logits are stock's too."""
    llm = Llama(str(model_path), moe_slots=4, n_ctx=64, logits_all=True, verbose=False)
    try:
        n_vocab = llm.n_vocab()
        mine = [t[0] for t in token_pieces(5, 0, 40, n_vocab)]
        other = token_pieces(6, 0, 40, n_vocab)
        (expected_other,) = stock_logits(model_path, [other], n_batch=8)
        stock = Llama(str(model_path), n_ctx=64, logits_all=True, verbose=False)  # as llm's own context
        try:
            for t in mine:
                stock.eval([t])
            expected_mine = np.array(stock.scores[: stock.n_tokens], copy=True)
        finally:
            stock.close()
        second = Context(llm._model.model, 8)
        got = {}

        def run_mine():
            for t in mine:
                llm.eval([t])
            got["mine"] = np.array(llm.scores[: llm.n_tokens], copy=True)

        def run_other():
            got["other"] = second.run(other)

        threads = [threading.Thread(target=run_mine), threading.Thread(target=run_other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        second.close()
        assert np.array_equal(got["mine"], expected_mine)
        assert np.array_equal(got["other"], expected_other)
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------------
# loads in two threads

REPACKED = "qwen3moe-q4_k"  # Q4_K: ggml repacks it on this CPU (AVX2) by default, so the layouts differ


def test_loads_in_two_threads_each_get_their_own_weight_layout(tmp_path_factory):
    """A plain-layout load (model_params(use_extra_bufts=False), as moe_repack=False and the
    bench's stock --no-repack runs use) and a default one, at the same moment in two threads: each
    gets its own layout, seen in its logits, which equal a load of that layout alone."""
    path = fixtures.write_fixture(REPACKED, tmp_path_factory.mktemp("layouts"))
    tokens = [int(t) for t in np.random.default_rng(7).integers(1, 200, size=12)]

    def logits(plain):
        if plain:
            with model_params(use_extra_bufts=False):
                llm = Llama(str(path), n_ctx=64, logits_all=True, verbose=False)
        else:
            llm = Llama(str(path), n_ctx=64, logits_all=True, verbose=False)
        try:
            llm.eval(tokens)
            return np.array(llm.scores[: llm.n_tokens], copy=True)
        finally:
            llm.close()

    alone = {plain: logits(plain) for plain in (False, True)}
    if np.array_equal(alone[False], alone[True]):
        pytest.skip("ggml does not repack Q4_0 on this CPU: both layouts give the same logits")
    for _ in range(3):
        start = threading.Barrier(2)
        got = {}

        def load(plain, start=start, got=got):
            start.wait()
            got[plain] = logits(plain)

        threads = [threading.Thread(target=load, args=(plain,)) for plain in (False, True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for plain in (False, True):
            assert np.array_equal(got[plain], alone[plain]), f"the {'plain' if plain else 'default'} load got the other layout"
