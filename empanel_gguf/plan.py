"""One planning entry point for every face (Llama, run, trace, serve, exec, bench):

    load = plan_load(index, "25%", llama_kwargs, policy="lfu-decay")
    Llama(path, moe_slots=load.moe_slots, ...)

plan_load decides the slots (sizing.py; "auto" against the available memory), estimates what the
load keeps resident (estimate.py) and lets the memory guard refuse it (guard.py). Its LoadPlan
carries what each face reports, as the same lines (LoadPlan.report()).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .estimate import Estimate, estimate, model_shape
from .format import format_bytes
from .guard import check, max_slots_that_fit
from .host_memory import available_memory, default_floor
from .sizing import DEFAULT_POLICY, SlotPlan, plan_slots

# the Llama arguments the estimate reads, with llama-cpp-python's defaults
# (gpu_offload: whether n_gpu_layers can offload; None: ask the build and its devices)
ESTIMATE_KWARGS = {"n_ctx": 512, "n_batch": 512, "n_ubatch": 512, "n_gpu_layers": 0, "logits_all": False,
                   "flash_attn": False, "type_k": None, "type_v": None, "gpu_offload": None}


@dataclass
class LoadPlan:
    requested: object            # moe_slots as asked (None, "auto", 32, "25%", "6GiB")
    moe_slots: object            # what to give Llama: None (every expert resident) or a count/share/size
    plan: SlotPlan | None        # slots per layer, None without slot pools
    estimate: Estimate           # what the load keeps resident
    available: int | None        # bytes of memory available now (None: unknown)
    floor: int                   # bytes kept free
    notes: list = field(default_factory=list)  # what was decided and adjusted, for the log

    def report(self, index):
        """The lines every face logs before the load: notes, the pools, the memory."""
        lines = list(self.notes)
        if self.plan is not None:
            lines += self.plan.notices
            lines.append(f"{self.plan.min_slots} of {self.plan.n_expert} expert slots per paged MoE layer, "
                         f"{format_bytes(self.plan.pool_bytes)} of pools instead of "
                         f"{format_bytes(index.expert_bytes_total)} of experts")
        lines.append(f"memory: about {format_bytes(self.estimate.host)} needed, "
                     f"{format_bytes(self.available)} available, {format_bytes(self.floor)} kept free")
        return lines


def wants_preload(plan, have_profile, moe_preload):
    """Whether a load reads experts into the empty slots right after it: moe_preload None (auto)
    does when the pools hold every expert (resident from the first token, as a stock load) or a
    calibration profile says which experts to take first."""
    if plan is None:
        return False
    return (plan.holds_all or have_profile) if moe_preload is None else bool(moe_preload)


def parse_moe_slots(value):
    """CLI/env text -> what Llama(moe_slots=...) takes: None, 'auto', an int, or the text."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if text.lower() in ("", "none", "off", "no", "false", "0"):
        return None
    if text.lower() == "auto":
        return "auto"
    if text.isdigit():
        return int(text)
    return text


def plan_load(index, moe_slots, llama_kwargs=None, *, policy=DEFAULT_POLICY, resident_layers=0, floor=None,
              force=False, available=None, what=None) -> LoadPlan:
    """Decide the slots and check memory before a load.

    moe_slots: None (every expert resident), 'auto', or anything plan_slots takes. 'auto' keeps
    every expert resident when that fits, else the most slots that fit (at least top-k).
    resident_layers: the first MoE layers keep every expert (sizing.plan_slots).
    llama_kwargs: the Llama arguments (n_ctx, n_batch, n_ubatch, n_gpu_layers, logits_all,
    flash_attn, type_k, type_v; others are ignored). Raises guard.MemoryRefused, or
    sizing.SlotsError for impossible moe_slots."""
    requested = moe_slots
    given = llama_kwargs or {}
    kwargs = {key: given.get(key, default) for key, default in ESTIMATE_KWARGS.items()}
    kwargs["shape"] = model_shape(index)
    notes = []
    if available is None:
        available = available_memory()
    floor = default_floor() if floor is None else floor
    what = what or f"loading {Path(index.path).name}"

    if moe_slots == "auto":
        if not index.is_moe:
            moe_slots = None
        else:
            full = estimate(index, None, **kwargs)
            if available is None or full.host <= available - floor:
                moe_slots = None
                notes.append(f"moe-slots auto: all {index.n_expert} experts per layer fit in memory"
                             + ("" if available is not None else " (available memory unknown)"))
            else:
                # the fewest slots if none fit: check() below then refuses with the advice
                moe_slots = max(max_slots_that_fit(index, available - floor, full.params, resident_layers),
                                index.n_expert_used)
                notes.append(f"moe-slots auto: {moe_slots} of {index.n_expert} expert slots per "
                             f"layer fit in {format_bytes(available - floor)} (available minus floor)")
    if moe_slots is not None and not index.is_moe:
        notes.append(f"{Path(index.path).name} has no routed experts; --moe-slots ignored")
        moe_slots = None

    plan = plan_slots(index, moe_slots, policy, resident_layers) if moe_slots is not None else None
    est = estimate(index, plan, **kwargs)
    notes += est.notes
    check(est, index, plan, available=available, floor=floor, force=force, what=what)
    return LoadPlan(requested=requested, moe_slots=moe_slots, plan=plan, estimate=est,
                    available=available, floor=floor, notes=notes)
