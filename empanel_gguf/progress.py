"""Progress of long prompt evaluations: a line on stderr that says tokens done of total and tok/s.

    llm.prompt_progress = PromptProgress()   # run and trace set it; Llama.eval uses it

A prompt that takes more than `after_s` seconds shows the line (refreshed in place on a terminal)
and ends with a summary. Tokens done come from llama-cpp-python's n_tokens (per n_batch chunk)
and, with slot pools, from the sidecar's per-layer micro-batch counters (so one long micro-batch
moves the line layer by layer).
"""

import sys
import threading
import time


class PromptProgress:
    def __init__(self, stream=None, after_s=1.0, every_s=0.25, label="prompt"):
        self.stream = stream if stream is not None else sys.stderr
        self.after_s = after_s
        self.every_s = every_s
        self.label = label

    def track(self, llm, n_total):
        return _Tracking(self, llm, n_total)


class _Tracking:
    def __init__(self, progress, llm, n_total):
        self.p, self.llm, self.n_total = progress, llm, n_total
        self.stop = threading.Event()
        self.shown = False

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.n0 = self.llm.n_tokens
        self.b0 = self._micro_batches()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        elapsed = time.perf_counter() - self.t0
        if elapsed >= self.p.after_s:
            done = self.llm.n_tokens - self.n0
            self._write(f"{self.p.label}: {done} tokens in {elapsed:.1f} s ({done / elapsed:.1f} tok/s)",
                        final=True)
        return False

    def _micro_batches(self):
        """Micro-batches done so far over the paged layers (fractional: layers done / layers)."""
        experts = getattr(self.llm, "_experts", None)
        if experts is None:
            return None
        layers = experts.stats()["layers"]
        return sum(row["n_remaps"] for row in layers.values()) / max(1, len(layers))

    def _done(self):
        done = self.llm.n_tokens - self.n0
        b = self._micro_batches()
        if b is not None and self.b0 is not None:
            n_ubatch = self.llm.context_params.n_ubatch
            done = max(done, int((b - self.b0) * n_ubatch))
        return min(done, self.n_total)

    def _loop(self):
        while not self.stop.wait(self.p.every_s):
            elapsed = time.perf_counter() - self.t0
            if elapsed < self.p.after_s:
                continue
            done = self._done()
            if self.p.stream.isatty() or not self.shown:
                pct = 100 * done / self.n_total if self.n_total else 100
                bar = "#" * int(pct / 5) + "." * (20 - int(pct / 5))
                self._write(f"{self.p.label}: [{bar}] {done}/{self.n_total} tokens ({pct:.0f} %), "
                            f"{done / elapsed:.1f} tok/s")

    def _write(self, text, final=False):
        tty = self.p.stream.isatty()
        if tty:
            self.p.stream.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            self.p.stream.write(text + "\n")
        self.p.stream.flush()
        self.shown = True
