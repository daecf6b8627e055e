"""`empanel-gguf bench [-m MODEL.gguf | --write-model PATH] [options]`: empanel-gguf against stock
llama.cpp on the same model and build, side by side, llama-bench style (see empanel_gguf/lab/bench/).

The benchmark's one entry point: its children run as `python -m empanel_gguf bench --child SPEC`,
and scripts/bench.py calls main() here with issue 4's targets as a report."""


def main(argv, reports=()):
    """reports: (title, fn(bench, rows) -> lines), printed after the tables and kept in the JSON."""
    from ..lab.bench import main as bench_main

    return bench_main(argv, reports=reports)
