"""The memory guard: refuse a load whose estimate (estimate.py) does not fit, say what would, and
watch while running.

`check()` compares the host part of an estimate that becomes resident with the available memory
minus a floor, and what it reserves with the address space left (`ulimit -v`, strict
overcommit), and raises MemoryRefused, with what to set instead (fewer slots, a smaller context),
unless forced.
`Watchdog` polls the available memory while a model runs (twice a second, one small file read)
and calls back once when it falls below the floor, so that the command can stop cleanly before
the kernel's OOM killer stops it uncleanly.
"""

from __future__ import annotations

import math
import sys
import threading

from .estimate import Estimate, estimate
from .format import GiB, KiB, MiB, format_bytes
from .host_memory import address_space_left, available_memory
from .sizing import plan_slots


class MemoryRefused(RuntimeError):
    """The estimated resident set does not fit in the available memory minus the floor."""


def check(est: Estimate, index=None, plan=None, *, available, floor, force=False, what="this load",
          address_space=None):
    """Raise MemoryRefused if est.host > available - floor, or est.host_reserved > the address
    space left (address_space, None: measured), unless force; return the headroom.

    The message says what fits instead: how many slots per layer, which context size."""
    check_address_space(est, address_space_left() if address_space is None else address_space, force, what)
    if available is None:
        return None
    budget = available - floor
    if est.host <= budget:
        return budget - est.host
    lines = [f"{what} needs about {format_bytes(est.host)} ({est.describe()}), but only "
             f"{format_bytes(available)} is available and {format_bytes(floor)} is kept free "
             f"(--mem-floor): {format_bytes(est.host - budget)} too much."]
    lines += [f"  - {text}" for text in advice(est, index, plan, budget)]
    lines.append("  - or --force to load anyway (the kernel may kill the process)")
    message = "\n".join(lines)
    if force:
        print(f"empanel: warning: {message}", file=sys.stderr)
        return budget - est.host
    raise MemoryRefused(message)


def check_address_space(est: Estimate, left, force=False, what="this load"):
    """Raise MemoryRefused if the load would reserve more address space than `left` bytes (None:
    no limit): llama.cpp would fail an allocation part way through the load."""
    if left is None or est.host_reserved <= left:
        return
    message = (f"{what} reserves about {format_bytes(est.host_reserved)} of address space ({est.describe()}), "
               f"but only {format_bytes(left)} may be mapped (ulimit -v, or vm.overcommit_memory=2: CommitLimit "
               "less Committed_AS):\n  - a smaller micro-batch (--moe-batch 512, or -b / -ub 256 with -fa on), a "
               "smaller context (-c) or fewer slots\n  - or raise the limit (--force loads anyway, and llama.cpp "
               "then fails an allocation)")
    if force:
        print(f"empanel: warning: {message}", file=sys.stderr)
        return
    raise MemoryRefused(message)


def advice(est: Estimate, index, plan, budget):
    """What to set so that the estimate fits in `budget` bytes of host memory."""
    out = []
    if index is not None and index.is_moe:
        resident_layers = plan.resident_layers if plan is not None else 0
        slots = max_slots_that_fit(index, budget, est.params, resident_layers)
        if slots >= index.n_expert_used:
            size = slots * sum(layer.expert_bytes for layer in index.layers)
            out.append(f"fewer slots: --moe-slots {slots} (of {index.n_expert} experts per layer, "
                       f"{format_bytes(size)} of pools; or a budget: --moe-slots {_size_arg(size)})")
        else:
            out.append(f"even the fewest slots (--moe-slots {index.n_expert_used}, the experts one "
                       "token uses) do not fit with this context")
    if est.kv_per_token:
        fixed = est.host - int(est.kv * est.host_share)
        room = budget - fixed
        n_ctx = int(room // max(1, est.kv_per_token * est.host_share)) if room > 0 else 0
        n_ctx = n_ctx // 256 * 256
        if 256 <= n_ctx < est.n_ctx:
            out.append(f"a smaller context: -c {n_ctx} (now {est.n_ctx}, "
                       f"{format_bytes(est.kv_per_token)} of KV cache per token)")
    out.append("a lower --mem-floor, or free memory (other processes, page cache)")
    return out


def max_slots_that_fit(index, budget, params, resident_layers=0):
    """The most slots per layer (top-k .. n_expert) whose estimate fits in `budget`; 0 if none.
    More slots mean larger pools and larger micro-batches, so the estimate grows with them."""
    lo, hi = index.n_expert_used, index.n_expert

    def fits(n):
        return estimate(index, plan_slots(index, n, resident_layers=resident_layers), **params).host <= budget

    if not fits(lo):
        return 0
    while lo < hi:  # fits(lo) holds
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _size_arg(n):
    """A budget that plan_slots turns into no more slots than n bytes hold (rounded down)."""
    if n >= GiB:
        return f"{math.floor(n / GiB * 10) / 10:g}GiB"
    if n >= MiB:
        return f"{n // MiB}MiB"
    return f"{n // KiB}KiB"


class Watchdog:
    """Calls on_low(available, floor) once, from its own thread, when the available memory falls
    below `floor`. `tripped` tells the main loop to stop; stop() ends the thread. budget_fn: the
    pools' moe_stats()["budget"] (or None): elastic pools that can still give memory back keep
    the run going, their controller shrinks them (csrc/pressure.c); it stops once their budget is
    at its floor and less than half their reserve is left."""

    def __init__(self, floor, on_low=None, *, interval=0.5, available_fn=available_memory, budget_fn=None):
        self.floor = floor
        self.on_low = on_low
        self.budget_fn = budget_fn
        self.interval = interval
        self.available_fn = available_fn
        self.tripped = threading.Event()
        self.available_at_trip = None
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        if self.floor <= 0 or self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="empanel-memory-watchdog", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while True:
            try:
                available = self.available_fn()
            except Exception:
                available = None
            if available is not None and available < self.floor and not self._gives_back(available):
                self.available_at_trip = available
                self.tripped.set()
                if self.on_low is not None:
                    self.on_low(available, self.floor)
                return
            if self._stop.wait(self.interval):
                return

    def _gives_back(self, available):
        try:
            budget = self.budget_fn() if self.budget_fn is not None else None
        except Exception:
            budget = None
        if not budget or not budget.get("elastic"):
            return False
        return budget["budget_bytes"] > budget["floor_bytes"] or available >= budget["reserve_bytes"] // 2

    def message(self):
        return (f"empanel: stopping: available memory fell to {format_bytes(self.available_at_trip)}, "
                f"below the floor of {format_bytes(self.floor)} (--mem-floor)")

    def stop(self):
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
