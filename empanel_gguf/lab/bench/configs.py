"""The benchmark's configurations: stock, stock from the mapping, empanel at a slot share; uncapped or under the cap."""

from __future__ import annotations

from dataclasses import dataclass


STOCK, MMAP, EMPANEL, CEILING = "stock", "stock-mmap", "empanel", "ceiling"
CAP_NONE, CAP = "none", "cap"
DEFAULT_CONFIGS = (
    [f"{n}@{CAP_NONE}" for n in ("stock", "empanel-100%", "empanel-50%", "empanel-25%", "empanel-min")]
    + [f"{n}@{CAP}" for n in ("stock", "stock-mmap", "stock-mmap-ra128", "empanel-100%", "empanel-50%",
                              "empanel-25%", "empanel-min", "empanel-auto")])


@dataclass
class Config:
    name: str  # stock | stock/plain | stock-mmap | stock-mmap-ra<KB> | empanel-<moe_slots>
    cap: str  # none | cap
    kind: str  # stock | stock-mmap | empanel
    moe_slots: object = None  # for empanel: what Llama(moe_slots=) gets
    readahead_kb: int | None = None  # stock-mmap-ra<KB>: read_ahead_kb during the run
    moe_policy: str | None = None  # empanel-<slots>/<policy>: this run's moe_policy
    moe_opts: dict | None = None  # empanel-<slots>/<key>=<value>: this run's moe_<key> (prefetch=1, guess=off)
    plain: bool = False  # empanel-<slots>/plain: no CPU repack buffers (use_extra_bufts=False): plain pools;
                         # stock/plain: stock resident so (llama.cpp --no-repack)
    bounce: bool = False  # empanel-<slots>/bounce: no read lands in place (EMPANEL_READ_BOUNCE=1), the
                          # copies that zero-copy reads save, measured side by side
    sync: bool = False  # empanel-<slots>/sync: every remap waits for its reads (EMPANEL_READ_SYNC=1), the
                        # overlap of reads and compute in decode measured side by side
    env: dict | None = None  # empanel-<slots>/EMPANEL_<NAME>=<value>: the run's environment has it (a
                             # switch such as EMPANEL_READ_AHEAD_KEEP=1, measured side by side)
    pools_batch: bool = False  # ceiling: stock --no-repack resident at the micro-batch and attention
                               # the pools plan (moe_batch): the compute of a prompt with no read at
                               # all, after a warm-up even under --no-warmup (its weights mapped)

    @property
    def key(self):
        return f"{self.name}@{self.cap}"


def parse_config(text: str, top_k: int) -> list[Config]:
    """'name' (uncapped and capped), 'name@none' or 'name@cap' -> Configs."""
    name, _, cap = text.strip().partition("@")
    caps = [cap] if cap else [CAP_NONE, CAP]
    for c in caps:
        if c not in (CAP_NONE, CAP):
            raise SystemExit(f"bench: config '{text}': the part after @ must be 'none' or 'cap'")
    if name == STOCK:
        kind, slots, ra = STOCK, None, None
    elif name == STOCK + "/plain":  # stock resident without CPU repack buffers: llama.cpp --no-repack
        return [Config(name, c, STOCK, plain=True) for c in caps]
    elif name == CEILING:  # the same at the pools' micro-batch: the no-read ceiling of their prompts
        return [Config(name, c, STOCK, plain=True, pools_batch=True) for c in caps]
    elif name == MMAP:
        kind, slots, ra = MMAP, None, None
    elif name.startswith(MMAP + "-ra") and name[len(MMAP) + 3:].isdigit():
        kind, slots, ra = MMAP, None, int(name[len(MMAP) + 3:])
    elif name.startswith(EMPANEL + "-") and len(name) > len(EMPANEL) + 1:
        from ...abi.header import ENGINE_POLICIES

        value, *parts = name[len(EMPANEL) + 1:].split("/")
        kind, ra = EMPANEL, None
        slots = top_k if value == "min" else int(value) if value.isdigit() else value
        policy, opts, plain, bounce, sync, env = None, {}, False, False, False, {}
        for part in parts:
            if part == "plain":  # pools in the plain layout: reads land in the slots, no repack
                plain = True
            elif part == "bounce":  # every read copied out of a bounce buffer (as before zero-copy reads)
                bounce = True
            elif part == "sync":  # reads never overlap the layer's compute (as before empanel_ready)
                sync = True
            elif part.startswith("EMPANEL_") and "=" in part:  # an environment switch of the sidecar
                key, _, value = part.partition("=")
                env[key] = value
            elif "=" in part:  # a Llama moe_* option of this run: prefetch=1, guess=off, profile=PATH
                key, opt = parse_opt(part)
                opts[key if key.startswith("moe_") else f"moe_{key}"] = opt
            elif part in ENGINE_POLICIES:
                policy = part
            else:
                raise SystemExit(f"bench: config '{text}': '{part}' is neither a policy "
                                 f"({', '.join(ENGINE_POLICIES)}), 'plain', 'bounce', 'sync' nor key=value")
        return [Config(name, c, kind, slots, ra, policy, opts or None, plain, bounce, sync, env or None) for c in caps]
    else:
        raise SystemExit(f"bench: unknown config '{text}'; use stock, stock/plain, ceiling, stock-mmap, stock-mmap-ra<KB>, "
                         "empanel-<N|P%|size|min|auto>[/<policy>][/plain][/bounce][/sync][/<key>=<value>...]"
                         "[/EMPANEL_<NAME>=<value>...], each optionally "
                         "@none or @cap")
    return [Config(name, c, kind, slots, ra) for c in caps]


def parse_opt(text: str):
    """'key=value' -> (key, int | float | bool | None | str)."""
    key, eq, raw = text.partition("=")
    if not eq or not key:
        raise SystemExit(f"bench: option '{text}' is not key=value")
    low = raw.lower()
    if low in ("true", "yes", "on"):
        return key, True
    if low in ("false", "no", "off"):
        return key, False
    if low == "none":
        return key, None
    for conv in (int, float):
        try:
            return key, conv(raw)
        except ValueError:
            pass
    return key, raw
