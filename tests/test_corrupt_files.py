"""Corrupt model files end in a clear Python error, never in a signal or a hang.

Each load of a corrupt file runs in a child process: an abort there would otherwise take the
test session down with it. The seeded fuzzer (scripts/fuzz_gguf.py) flips bytes of the header
region of several fixtures and of the built-in model, bounded in time.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest
from conftest import child_env

from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.planning.index import ModelError
from empanel_gguf.commands.options import BUILTIN_MODEL

REPO = Path(__file__).resolve().parent.parent

# load with slots and as stock, in a child; print what each ended in
LOAD_BOTH = textwrap.dedent("""
    import sys
    from empanel_gguf import Llama
    for slots in ("25%", None):
        try:
            llm = Llama(sys.argv[1], moe_slots=slots, n_ctx=64, n_threads=1, verbose=False)
            llm.eval(llm.tokenize(b"Hello", add_bos=True))
            llm.close()
            print("loaded")
        except ValueError as e:
            print("ValueError", e)
""")


def _load_in_child(path):
    proc = subprocess.run([sys.executable, "-c", LOAD_BOTH, str(path)], capture_output=True, text=True,
                          timeout=120, env=child_env())
    assert proc.returncode == 0, f"the load died (status {proc.returncode}):\n{proc.stderr[-2000:]}"
    return proc.stdout.splitlines()


@pytest.fixture(scope="module")
def q4k(tmp_path_factory):
    return fixtures.write_fixture("qwen3moe-q4_k", tmp_path_factory.mktemp("corrupt"))


def _string_offsets(path, key):
    """(file offset, length) of each string of the metadata array `key`."""
    reader = gguf.GGUFReader(path)
    field = reader.fields[key]
    base = reader.data.ctypes.data
    return [(field.parts[i].ctypes.data - base, len(field.parts[i])) for i in field.data]


def test_a_token_that_appears_twice_is_an_error_not_an_abort(q4k, tmp_path):
    """The issue's case: one byte of a token string changed so that two tokens are equal."""
    data = bytearray(q4k.read_bytes())
    tokens = _string_offsets(q4k, "tokenizer.ggml.tokens")
    # two tokens of the same length: the second becomes a copy of the first
    by_length = {}
    for offset, n in tokens:
        by_length.setdefault(n, []).append(offset)
    n, (first, second, *_) = next((n, offs) for n, offs in by_length.items() if len(offs) >= 2)
    data[second:second + n] = data[first:first + n]
    path = tmp_path / "twice.gguf"
    path.write_bytes(bytes(data))
    results = _load_in_child(path)
    assert len(results) == 2
    for line in results:
        assert line.startswith("ValueError") and "Failed to load model" in line


def test_bad_hyperparameters_are_errors_not_aborts(q4k, tmp_path):
    """llama.cpp asserts on these (expert counts, the norm epsilon); our patch makes them throw."""
    reader = gguf.GGUFReader(q4k)
    cases = {"qwen3moe.expert_used_count": 0, "qwen3moe.expert_count": 2,
             "qwen3moe.attention.layer_norm_rms_epsilon": -1.0}
    for key, value in cases.items():
        field = reader.fields[key]
        offset = field.parts[field.data[0]].ctypes.data - reader.data.ctypes.data
        data = bytearray(q4k.read_bytes())
        fmt = "<f" if isinstance(value, float) else "<I"
        data[offset:offset + 4] = struct.pack(fmt, value)
        path = tmp_path / f"{key}.gguf"
        path.write_bytes(bytes(data))
        for line in _load_in_child(path):
            assert line.startswith("ValueError"), (key, line)


def test_a_chat_template_that_does_not_parse_names_the_file(q4k, tmp_path):
    data = bytearray(q4k.read_bytes())
    (offset, n), = _string_offsets(q4k, "tokenizer.chat_template")
    template = bytes(data[offset:offset + n])
    broken = template.replace(b"endfor", b"endfxr", 1)
    assert broken != template
    data[offset:offset + n] = broken
    path = tmp_path / "template.gguf"
    path.write_bytes(bytes(data))
    for moe_slots in ("25%", None):
        with pytest.raises(ModelError, match="chat template"):
            Llama(str(path), moe_slots=moe_slots, n_ctx=64, verbose=False)
    llm = Llama(str(q4k), moe_slots="25%", n_ctx=64, verbose=False)  # nothing lost
    llm.close()


# the seeded fuzzer: (model, cases); about 10 ms a case on the fixtures, 35 ms on the built-in model
FUZZ = [("qwen3moe-q4_k", 800), ("mixtral", 300), ("gpt-oss", 300), ("qwen2moe", 300), ("builtin", 300)]


@pytest.mark.parametrize("name,cases", FUZZ)
def test_seeded_fuzzer_finds_no_crash_or_hang(name, cases, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"fuzz-{name}")
    model = BUILTIN_MODEL if name == "builtin" else fixtures.write_fixture(name, work)
    out = work / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fuzz_gguf.py"), str(model), "--cases", str(cases),
         "--seed", "0", "--seconds", "60", "--case-timeout", "30", "--workdir", str(work), "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=child_env())
    summary = json.loads(out.read_text())
    assert proc.returncode == 0 and not summary["findings"], proc.stdout[-3000:]
    assert summary["cases"] >= min(cases, 100)  # bounded by time, but it ran
    # the cases reached llama.cpp: most end in an error, some load and decode
    assert summary["outcomes"]["stock"].get("ok", 0) > 0 and summary["outcomes"]["stock"].get("error", 0) > 0
