"""Models empanel-gguf writes and ships.

    fixtures      tiny random-weight MoE GGUF files: the fallback model of `empanel-gguf run`,
                  the tests' and scripts' models
    gguf_writer   what every writer shares: hyperparameters, the tokenizer, copying a GGUF
                  without some tensors (used by fixtures, lab/bench/synthetic.py and
                  scripts/train_moe.py)

The built-in model's data lives here too: shakespeare-moe.gguf and its PROVENANCE.md
(scripts/train_moe.py). The writers stand on planning's GGUF reader only: nothing of the engine,
the lab or the faces. This file imports nothing.
"""
