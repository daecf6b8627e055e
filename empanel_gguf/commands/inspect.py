"""`empanel-gguf inspect MODEL.gguf [--json]`: where the routed experts of a GGUF model lie.

Reads only the GGUF headers. Prints the architecture, expert counts, sizes, the bytes a token
reads with no expert cached, and one row per MoE layer with the offsets of expert 0.
"""

from __future__ import annotations

import argparse
import json
import sys

from empanel_gguf.planning.format import format_bytes
from empanel_gguf.planning.index import ModelError, ModelIndex, load_index
from empanel_gguf.planning.options import CommandParser


def setup_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    if parser is None:
        parser = CommandParser(prog="empanel-gguf inspect", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="GGUF model file (for a split model: any of its shards)")
    parser.add_argument("--json", action="store_true", help="print the full index as JSON")
    return parser


def format_summary(index: ModelIndex) -> str:
    lines = [
        f"model           {index.path}",
        f"shards          {len(index.shards)}",
        f"architecture    {index.architecture}",
        f"layers          {index.n_layer} ({len(index.layers)} MoE)",
        f"experts         {index.n_expert} per MoE layer, top-k {index.n_expert_used}",
        f"routed experts  {format_bytes(index.expert_bytes_total)} ({index.expert_bytes_total} bytes)",
        f"everything else {format_bytes(index.other_bytes_total)} ({index.other_bytes_total} bytes)",
        f"cold per token  {format_bytes(index.cold_bytes_per_token)} ({index.cold_bytes_per_token} bytes, "
        f"top-k experts of every MoE layer, no cache hits)",
    ]
    if index.n_layer_nextn:
        blocks = ", ".join(str(il) for il in index.mtp_layers)
        lines.append(f"MTP blocks      {blocks} ({len(index.mtp_skipped)} MoE): not counted above; llama.cpp "
                     f"loads them only for MTP drafting ({format_bytes(index.mtp_skipped_bytes)})")
    if not index.layers:
        lines.append("no routed expert tensors (blk.N.ffn_*_exps.weight): not a MoE model")
        return "\n".join(lines) + "\n"

    tensors = [t for layer in index.layers for t in layer.tensors.values()]
    in_place = sum(t.lands_in_place for t in tensors)
    lines.append(f"reads in place  {in_place} of {len(tensors)} expert tensors (expert size a multiple of "
                 "the O_DIRECT block): reads land in plain pools' slots uncopied, the rest through a bounce buffer")

    # One row per MoE layer: kinds, their types, bytes of one expert (all kinds), expert-0 offsets.
    multi_shard = len(index.shards) > 1
    header = ["layer", "kinds", "types", "expert bytes", "expert 0 offsets"]
    rows = []
    for layer in index.layers:
        tensors = list(layer.tensors.values())
        offsets = " ".join(f"{t.kind}={t.offset}" + (f"@{t.shard}" if multi_shard else "") for t in tensors)
        rows.append([str(layer.layer), ",".join(t.kind for t in tensors), ",".join(t.type_name for t in tensors),
                     str(layer.expert_bytes), offsets])
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header) - 1)]
    lines.append("")
    for row in [header] + rows:
        cells = [c.rjust(w) if i in (0, 3) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    if multi_shard:
        lines.append("(offset@N: absolute offset in shard N)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    try:
        index = load_index(args.model)
    except ModelError as e:
        print(f"empanel-gguf inspect: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(index.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_summary(index))
    return 0


if __name__ == "__main__":
    sys.exit(main())
