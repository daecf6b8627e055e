"""Progress of long prompt evaluations (empanel_gguf.progress), on a real load."""

import io
import threading

from empanel_gguf import Llama
from empanel_gguf.models import fixtures
from empanel_gguf.progress import PromptProgress


def test_prompt_progress_lines(tmp_path):
    path = fixtures.write_fixture("qwen3moe-f32", tmp_path)
    llm = Llama(str(path), n_ctx=1024, n_batch=128, verbose=False, moe_slots=4)
    try:
        written = threading.Event()

        class Stream(io.StringIO):  # not a terminal: one progress line, then the summary
            def write(self, text):
                written.set()
                return super().write(text)

        out = Stream()
        llm.prompt_progress = PromptProgress(stream=out, after_s=0.0, every_s=0.001)
        tokens = llm.tokenize(b"the quick brown fox jumps over the lazy dog " * 40)[:600]
        decode = llm._ctx.decode

        def decode_after_the_line(batch):  # the prompt's chunks wait until the line is out
            assert written.wait(30), "no progress line within 30 s"
            return decode(batch)

        llm._ctx.decode = decode_after_the_line
        try:
            llm.eval(tokens)
        finally:
            llm._ctx.decode = decode
        lines = out.getvalue().splitlines()
        assert len(lines) == 2, lines
        assert lines[0].startswith("prompt: [") and "0/600 tokens (0 %)" in lines[0], lines
        assert lines[-1].startswith("prompt: 600 tokens in ") and "tok/s" in lines[-1]
        # one token (a decode step) shows nothing
        out.truncate(0)
        out.seek(0)
        llm.eval([tokens[-1]])
        assert out.getvalue() == ""
    finally:
        llm.close()
