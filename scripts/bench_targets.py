"""Issue 4's targets for `empanel-gguf bench`, each measured or said why not: printed by
`python scripts/bench.py ...` after the tables (kept out of the shipped package)."""

from empanel_gguf.lab.bench.configs import CAP, CAP_NONE, EMPANEL, MMAP, STOCK
from empanel_gguf.lab.bench.report import fmt, fmt_bytes, kv_bytes
from empanel_gguf.lab.bench.runs import find_row, median
from empanel_gguf.planning.sizing import DEFAULT_POLICY, plan_slots

TITLE = "targets (issue 4)"


def targets(bench, rows) -> list[str]:
    """Issue 4's targets, each measured or said why not."""

    lines = []
    stock = find_row(rows, STOCK, CAP_NONE)
    full = find_row(rows, "empanel-100%", CAP_NONE)
    if stock and full:
        r = full["tg_tps"] / stock["tg_tps"]
        lines.append(f"- 100% slots vs stock resident decode: {full['tg_tps']:.2f} / {stock['tg_tps']:.2f} t/s "
                     f"= {r:.3f}x (target >= 0.99) {'MET' if r >= 0.99 else 'MISSED'}; "
                     f"tg hit rate {fmt(100 * full['tg_hit'] if full.get('tg_hit') is not None else None, '.1f')}%")
    else:
        lines.append("- 100% slots vs stock resident: not measured (needs stock@none and empanel-100%@none)")
    mmap128 = None
    for row in rows:
        if row["kind"] == MMAP and row["cap"] == CAP and row["status"].startswith("ok") and \
                (row["config"].endswith("-ra128")):
            mmap128 = row
    capped = [r for r in rows if r["kind"] == EMPANEL and r["cap"] == CAP and r["status"].startswith("ok")]
    if mmap128 and capped:
        best = max(capped, key=lambda r: r["tg_tps"])
        r = best["tg_tps"] / mmap128["tg_tps"]
        lines.append(f"- under the cap: best empanel ({best['config']}) {best['tg_tps']:.2f} t/s vs stock mmap "
                     f"@128 KiB readahead {mmap128['tg_tps']:.2f} t/s = {r:.1f}x (target >= 3) "
                     f"{'MET' if r >= 3 else 'MISSED'}")
    else:
        lines.append("- under the cap vs stock mmap @128 KiB: not measured")
    for row in rows:
        if row["kind"] != EMPANEL or not row["status"].startswith("ok"):
            continue
        parts = [f"- {row['config']}@{row['cap']}:"]
        if row.get("pct_ceiling") is not None:
            parts.append(f"{row['tg_tps']:.2f} t/s = {row['pct_ceiling']:.0f}% of ceiling "
                         f"{row['ceiling_tps']:.2f} t/s (target >= 85%) {'MET' if row['pct_ceiling'] >= 85 else 'MISSED'};")
        if row.get("reader_pct_drive") is not None:
            parts.append(f"reader {row['tg_reader_gbps']:.2f} GB/s = {row['reader_pct_drive']:.0f}% of drive "
                         f"(target >= 85%) {'MET' if row['reader_pct_drive'] >= 85 else 'MISSED'};")
        if row.get("tg_wait_ms") is not None:
            resident_ms = 1000 / stock["tg_tps"] if stock and stock.get("tg_tps") else None
            parts.append(f"per token: waiting {row['tg_wait_ms']:.1f} ms (read {fmt(row.get('tg_read_ms'), '.1f')}, "
                         f"slot writes {fmt(row.get('tg_write_ms'), '.1f')}) + compute {fmt(row.get('tg_compute_ms'), '.1f')} ms "
                         f"(resident {fmt(resident_ms, '.1f')} ms);")
        try:
            policy = row.get("moe_policy") or dict(bench.args.moe_opt).get("moe_policy", DEFAULT_POLICY)
            pools = plan_slots(bench.index, row.get("moe_slots_resolved") or row["moe_slots"], policy).pool_bytes
        except Exception:  # noqa: BLE001  (a sizing error is reported, not raised)
            pools = None
        if pools is not None and row.get("peak_rss"):
            budget = 1.05 * (bench.index.other_bytes_total + pools + kv_bytes(bench))
            base = median([s.get("rss_baseline") for s in bench.samples
                            if s["config"] == row["config"] and s["cap"] == row["cap"] and s["status"] == "ok"
                            and not s.get("discarded")]) or 0
            ok = row["peak_rss"] - base <= budget
            parts.append(f"peak RSS {fmt_bytes(row['peak_rss'])} ({fmt_bytes(row['peak_rss'] - base)} without the "
                         f"{fmt_bytes(base)} interpreter) vs budget {fmt_bytes(budget)} "
                         f"(weights+pools+KV+5%) {'MET' if ok else 'MISSED'}")
        lines.append(" ".join(parts))
    return lines
