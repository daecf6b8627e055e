"""Progress of long prompt evaluations (empanel_gguf.progress), on a real load."""

import io

from empanel_gguf import Llama, fixtures
from empanel_gguf.progress import PromptProgress


def test_prompt_progress_lines(tmp_path):
    path = fixtures.write_fixture("qwen3moe-f32", tmp_path)
    llm = Llama(str(path), n_ctx=1024, n_batch=128, verbose=False, moe_slots=4)
    try:
        out = io.StringIO()  # not a terminal: one progress line, then the summary
        llm.prompt_progress = PromptProgress(stream=out, after_s=0.0, every_s=0.001)
        tokens = llm.tokenize(b"the quick brown fox jumps over the lazy dog " * 40)[:600]
        llm.eval(tokens)
        lines = out.getvalue().splitlines()
        assert lines[-1].startswith("prompt: 600 tokens in ") and "tok/s" in lines[-1]
        assert all(line.startswith("prompt: ") for line in lines)
        if len(lines) > 1:  # the loop got a look in before the end
            assert "/600 tokens (" in lines[0]
        # one token (a decode step) shows nothing
        out.truncate(0)
        out.seek(0)
        llm.eval([tokens[-1]])
        assert out.getvalue() == ""
    finally:
        llm.close()
