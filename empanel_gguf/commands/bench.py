"""`empanel-gguf bench [-m MODEL.gguf | --write-model PATH] [options]`: empanel-gguf against stock
llama.cpp on the same model and build, side by side, llama-bench style (see empanel_gguf/lab/bench/)."""


def main(argv):
    from ..lab.bench import main as bench_main

    return bench_main(argv)
