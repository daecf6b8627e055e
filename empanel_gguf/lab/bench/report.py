"""The benchmark's report: markdown tables and the details table. (An issue's targets are not
shipped: scripts/bench_targets.py prints them, through `python scripts/bench.py`.)"""

from __future__ import annotations


from .configs import CAP, CAP_NONE, CEILING, EMPANEL, MMAP, STOCK
from .runs import Bench

from ...planning.format import GiB, format_bytes


def fmt_bytes(n, unit=None):
    """Table cells: format_bytes, in GiB or MiB, '-' when unknown."""
    if n is not None and unit is None:
        unit = "GiB" if abs(n) >= GiB else "MiB"
    return format_bytes(n, unit, missing="-")


def fmt(v, spec=".2f", suffix=""):
    return "-" if v is None else f"{v:{spec}}{suffix}"


def markdown(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    numeric = [all(_looks_numeric(r[i]) for r in rows) for i in range(len(headers))]

    def line(cells):
        out = []
        for i, c in enumerate(cells):
            out.append(str(c).rjust(widths[i]) if numeric[i] else str(c).ljust(widths[i]))
        return "| " + " | ".join(out) + " |"

    sep = "| " + " | ".join(("-" * (w - 1) + ":") if numeric[i] else "-" * w
                            for i, w in enumerate(widths)) + " |"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def _looks_numeric(cell):
    text = str(cell).split(" ")[0].rstrip("%")
    try:
        float(text)
        return True
    except ValueError:
        return text == "-"


def model_label(bench: Bench) -> str:
    ix = bench.index
    types = sorted({t.type_name for t in ix.expert_tensors()})
    return f"{ix.architecture} {ix.n_layer}L {ix.n_expert}x top-{ix.n_expert_used} {'/'.join(types)}"


def cap_label(bench: Bench, cap: str) -> str:
    if cap == CAP_NONE:
        return "none"
    return f"{bench.cap_bytes / GiB:.1f} GiB ({100 * bench.args.cap:.0f}%)"


def slots_label(bench: Bench, row) -> str:
    if row["kind"] == STOCK:
        return "- (no repack)" if row["config"].endswith("/plain") or row["config"] == CEILING else "- (repack)"
    if row["kind"] == MMAP:
        return "- (mmap)"
    per = row.get("slots_per_layer")
    return f"{row['moe_slots']} ({per})" if per and str(per) != str(row["moe_slots"]) else str(row["moe_slots"])


def tps_cell(row, ph) -> str:
    v, sd = row.get(f"{ph}_tps"), row.get(f"{ph}_tps_sd")
    if v is None:
        return "-"
    prec = 2 if v < 100 else 1
    return f"{v:.{prec}f} ± {sd:.{prec}f}" if sd is not None else f"{v:.{prec}f}"


def main_table(bench: Bench, rows) -> str:
    a = bench.args
    headers = ["model", "size", "config", "moe_slots", "cap", "n_ubatch", "test", "t/s", "peak RSS",
               "read/tok", "hit %", "reader GB/s", "drive GB/s", "% ceil"]
    model, size = model_label(bench), fmt_bytes(bench.model_bytes, "GiB")
    out = []
    for row in rows:
        base = [model, size, row["config"], slots_label(bench, row), cap_label(bench, row["cap"])]
        if not row["status"].startswith("ok"):
            what = {"oom": "OOM-killed", "timeout": "timeout", "skipped": "skipped"}.get(row["status"], "error")
            phase = (row.get("error") or "").replace("OOM-killed ", "")
            out.append(base + ["-", "load" if "load" in phase else phase[:24], what,
                               fmt_bytes(row.get("peak_rss")), "-", "-", "-", "-", "-"])
            continue
        for ph, n in (("pp", row.get("n_pp", a.n_prompt)), ("tg", row.get("n_tg", a.n_gen))):
            empanel = row["kind"] == EMPANEL
            out.append(base + [
                row.get("n_ubatch", "-"), f"{ph}{n}", tps_cell(row, ph), fmt_bytes(row.get("peak_rss")),
                fmt_bytes(row.get(f"{ph}_read_per_tok")),
                fmt(100 * row[f"{ph}_hit"] if empanel and row.get(f"{ph}_hit") is not None else None, ".1f"),
                fmt(row.get(f"{ph}_reader_gbps")) if empanel else "-",
                fmt(row.get("drive_gbps")) if ph == "tg" and empanel else "-",
                fmt(row.get("pct_ceiling"), ".0f") if ph == "tg" and empanel else "-",
            ])
    return markdown(headers, out)


def details_table(bench: Bench, rows) -> str:
    """Where the decode time goes, per row (medians; ms per decoded token). 'cold': the warm-up
    run right after load, before the measured one."""
    headers = ["config", "cap", "status", "load s", "cold pp t/s", "cold tg t/s", "peak RSS", "predicted", "cgroup peak", "tg io/tok",
               "read ms", "write ms", "wait ms", "compute ms", "reader CPU ms", "process CPU ms", "of it sys ms", "switches/tok",
               "copied/tok", "disk GB/s busy", "disk busy %", "ceiling t/s",
               "reader % drive", "others' CPU %", "argmax = stock", "pp waves", "pp read", "pp hidden %",
               "pp wait ms", "tg guess recall %", "tg read-ahead used %", "tg read-ahead dropped %", "tg read-ahead waste/tok"]
    out = []
    for row in rows:
        status = row["status"] if row["status"].startswith("ok") else (row.get("error") or row["status"])[:40]
        out.append([row["config"], row["cap"], status, fmt(row.get("load_s"), ".1f"),
                    fmt(row.get("cold_pp_tps")), fmt(row.get("cold_tg_tps")), fmt_bytes(row.get("peak_rss")),
                    fmt_bytes(row.get("predicted_resident")), fmt_bytes(row.get("cgroup_peak")),
                    fmt_bytes(row.get("tg_io_per_tok")),
                    fmt(row.get("tg_read_ms"), ".1f"), fmt(row.get("tg_write_ms"), ".1f"),
                    fmt(row.get("tg_wait_ms"), ".1f"), fmt(row.get("tg_compute_ms"), ".1f"),
                    fmt(row.get("tg_read_cpu_ms"), ".1f"), fmt(row.get("tg_cpu_ms"), ".1f"),
                    fmt(row.get("tg_sys_ms"), ".1f"), fmt(row.get("tg_switches"), ".0f"),
                    fmt_bytes(row.get("tg_bounce_per_tok")),
                    fmt(row.get("tg_dev_gbps")), fmt(row.get("tg_dev_busy_pct"), ".0f"), fmt(row.get("ceiling_tps")), fmt(row.get("reader_pct_drive"), ".0f"),
                    fmt(row.get("others_cpu_pct"), ".0f"), row.get("argmax_agree", "-"),
                    fmt(row.get("pp_waves"), ".1f"), fmt_bytes(row.get("pp_read_bytes")),
                    fmt(row.get("pp_hidden_pct"), ".0f"), fmt(row.get("pp_wait_ms"), ".1f"),
                    fmt(100 * row["tg_guess_recall"] if row.get("tg_guess_recall") is not None else None, ".0f"),
                    fmt(row.get("tg_prefetch_used_pct"), ".0f"), fmt(row.get("tg_prefetch_dropped_pct"), ".0f"),
                    fmt_bytes(row.get("tg_prefetch_waste_per_tok"))])
    return markdown(headers, out)


def prompt_table(bench: Bench, rows) -> str:
    """The measured prompt as a user meets it (bench --no-warmup: cold, right after the load):
    prompt t/s and time to first token (load + prompt) against stock from the mapping (the first
    stock-mmap row under the cap) and the no-read ceiling (the ceiling row, measured after its
    warm-up), the expert bytes read per llama_decode call as a multiple of the model's, and how
    much of the prompt the drive was busy (its /sys stat, where the bench found the drive)."""
    ok = [row for row in rows if row["status"].startswith("ok")]
    anchor = next((row for row in ok if row["kind"] == MMAP and row["cap"] == CAP), None)
    ceiling = next((row for row in ok if row["config"] == CEILING), None)
    experts = bench.index.expert_bytes_total
    headers = ["config", "cap", "-b / -ub", "fa", "prompt", "load s", "prompt s", "TTFT s", "prompt t/s",
               "x stock-mmap", "TTFT / stock-mmap", "% ceiling", "read", "read per call / experts", "disk busy %"]
    out = []

    def ratio(a, b):
        return a / b if a and b else None

    for row in ok:
        out.append([row["config"], row["cap"], f"{row.get('n_batch', '-')} / {row.get('n_ubatch', '-')}",
                    "on" if row.get("flash_attn") else "off", row.get("n_pp", "-"), fmt(row.get("load_s"), ".1f"),
                    fmt(row.get("pp_s"), ".1f"), fmt(row.get("ttft_s"), ".1f"), fmt(row.get("pp_tps")),
                    fmt(ratio(row.get("pp_tps"), anchor and anchor.get("pp_tps"))),
                    fmt(ratio(row.get("ttft_s"), anchor and anchor.get("ttft_s"))),
                    fmt(100 * ratio(row.get("pp_tps"), ceiling and ceiling.get("pp_tps"))
                        if ceiling and row is not ceiling else None, ".0f"),
                    fmt_bytes(row.get("pp_bytes")),
                    fmt(row["pp_bytes"] / row["pp_calls"] / experts
                        if row.get("pp_bytes") is not None and row.get("pp_calls") and experts else None),
                    fmt(row.get("pp_dev_busy_pct"), ".0f")])
    return markdown(headers, out)


def neighbour_table(bench: Bench, rows) -> str:
    """bench --neighbour: who survived another program taking memory mid-decode in the same
    cgroup, and how fast decoding went before, with it and after it left (medians)."""
    a = bench.args
    headers = ["config", "cap", "status", "neighbour", "tg before t/s", "tg with t/s", "with / before",
               "tg after t/s", "budget lowest", "budget end / capacity", "given back", "shrink ms", "lock wait ms", "argmax = stock"]
    out = []
    for row in rows:
        ok = row["status"].startswith("ok")
        rc = row.get("neighbour_rc")
        who = ("-" if not ok else "killed" if rc is not None and rc < 0 else
               f"held in {row['neighbour_held_s']:.1f} s" if row.get("neighbour_held_s") is not None else f"rc {rc}")
        before, with_ = row.get("tg_before_tps"), row.get("tg_with_tps")
        out.append([row["config"], row["cap"], row["status"] if ok else (row.get("error") or row["status"])[:30], who,
                    fmt(before), fmt(with_), fmt(with_ / before if before and with_ else None),
                    fmt(row.get("tg_after_tps")), fmt_bytes(row.get("budget_lowest")),
                    f"{fmt_bytes(row.get('budget_end'))} / {fmt_bytes(row.get('budget_capacity'))}"
                    if row.get("budget_end") is not None else "-",
                    fmt_bytes(row.get("budget_given_back")), fmt(row.get("budget_shrink_ms"), ".1f"),
                    fmt(row.get("budget_lock_wait_ms"), ".1f"), row.get("argmax_agree", "-")])
    when = (f"{a.neighbour_in_prompt:g} s into the prompt" if a.neighbour_in_prompt is not None else
            f"{a.neighbour_in_load:g} s into the load" if a.neighbour_in_load is not None else
            "before the load" if a.neighbour_at == "load" else
            f"before decoded token {a.neighbour_at if a.neighbour_at is not None else a.n_gen // 4}")
    title = (f"neighbour: {format_bytes(a.neighbour)} taken {when}"
             + (f", freed before token {a.neighbour_leave}" if a.neighbour_leave is not None else ", held to the end"))
    return title + "\n\n" + markdown(headers, out)


def limit_table(bench: Bench, rows) -> str:
    """bench --lower-limit: the cgroup's limit written down mid-decode: whether and when it was
    taken, and decoding before, while refused and after (medians)."""
    a = bench.args
    headers = ["config", "cap", "status", "limit taken after", "refused", "tg before t/s", "tg refused t/s",
               "tg after t/s", "budget lowest", "kernel events", "argmax = stock"]
    out = []
    for row in rows:
        ok = row["status"].startswith("ok")
        taken = row.get("limit_taken_s")
        out.append([row["config"], row["cap"], row["status"] if ok else (row.get("error") or row["status"])[:30],
                    "-" if not ok else "never (15 s)" if taken is None or row.get("limit_never") else f"{taken:.2f} s",
                    fmt(row.get("limit_refused"), ".0f"), fmt(row.get("tg_before_tps")),
                    fmt(row.get("tg_refused_tps")), fmt(row.get("tg_after_tps")), fmt_bytes(row.get("budget_lowest")),
                    fmt(row.get("budget_events"), ".0f"), row.get("argmax_agree", "-")])
    at = a.lower_at if a.lower_at is not None else a.n_gen // 4
    title = (f"limit lowered: the cgroup's limit written down to {a.lower_limit:g} of the model file "
             f"({format_bytes(int(a.lower_limit * bench.model_bytes))}) before decoded token {at}, tried every 50 ms")
    return title + "\n\n" + markdown(headers, out)


def kv_bytes(bench: Bench) -> int:
    """The KV cache of the context the runs use (F16), as the memory guard estimates it."""
    from ...planning.estimate import estimate

    return estimate(bench.index, None, n_ctx=bench.args.n_ctx).kv
