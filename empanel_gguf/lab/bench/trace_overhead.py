"""What tracing costs: the same evaluations timed on fresh loads with and without moe_trace
(`empanel-gguf trace --overhead`). A benchmark, not a test: machines are noisy.
"""

from __future__ import annotations

import math
import time

from ..recorder import TAKE_EVERY


# ------------------------------------------------------------------------------------------------
# what tracing costs


def measure_overhead(model_path, schedule, repeats=3, **llama_kwargs):
    """Time the same evaluations on fresh loads with and without moe_trace, one load at a time,
    interleaved, `repeats` of each. Each evaluation's best time over the repeats counts (the
    least disturbed by other load on the machine; taking the records is timed with its
    evaluation). Returns seconds without and with tracing (sums of those best times) and the
    overhead (with / without - 1), in all and for the prompt and decode evaluations apart (a
    multi-threaded prompt on a busy machine is the noisier). `schedule`: (tokens, is_prompt) pairs as Recorder.schedule()
    gives; llama_kwargs: the Llama arguments of the run (moe_slots, moe_policy, n_ctx, ...)."""
    from ... import Llama

    best = {False: [math.inf] * len(schedule), True: [math.inf] * len(schedule)}
    kwargs = dict(llama_kwargs, verbose=False)
    clock = time.perf_counter
    for _ in range(repeats):
        for traced in (False, True):
            llm = Llama(str(model_path), moe_trace=traced, **kwargs)
            times = best[traced]
            try:
                for i, (tokens, prompt) in enumerate(schedule):
                    t0 = clock()
                    llm.eval(tokens)
                    # the Recorder takes the records after a prompt, at the end of a generation
                    # and every TAKE_EVERY evaluations
                    end_of_run = prompt or i + 1 == len(schedule) or schedule[i + 1][1]
                    if traced and (end_of_run or (i + 1) % TAKE_EVERY == 0):
                        llm.moe_take_trace()
                    times[i] = min(times[i], clock() - t0)
            finally:
                llm.close()
    def part(traced, prompt):
        return sum(t for t, (_, p) in zip(best[traced], schedule) if prompt is None or p == prompt)

    def overhead(prompt):
        plain = part(False, prompt)
        return part(True, prompt) / plain - 1.0 if plain > 0 else 0.0

    return dict(plain_s=part(False, None), traced_s=part(True, None), overhead=overhead(None),
                prompt_overhead=overhead(True), decode_overhead=overhead(False), repeats=repeats)
