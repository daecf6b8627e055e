"""The GGUF metadata every model we write carries, written one way: the test fixtures
(fixtures.py), the benchmark's synthetic model (lab/bench/synthetic.py) and the built-in model's
training (scripts/train_moe.py) all call these on a gguf.GGUFWriter.
"""

from __future__ import annotations

from pathlib import Path

# the tokenizer's control tokens and chat template (ChatML), shared by every model we write, so
# that `Llama.create_chat_completion` works with the metadata alone
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def add_model_hparams(w, *, n_ctx, n_embd, n_layer, n_head, n_head_kv, rms_eps, rope_base,
                      n_expert=0, n_expert_used=0):
    """The hyperparameters of every transformer we write; a dense model (n_expert 0) gets no
    expert keys at all."""
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_base)
    if n_expert > 0:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)


def add_tokenizer(w, tokens, types, merges, pre="default"):
    """A byte-level BPE vocabulary (gpt2 model) with BOS_TOKEN / EOS_TOKEN among `tokens` and the
    ChatML template."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(BOS_TOKEN))
    w.add_eos_token_id(tokens.index(EOS_TOKEN))
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)


def copy_without_tensors(src, dst, drop) -> list:
    """Copy the GGUF file `src` to `dst` without the tensors whose name `drop(name)` is true:
    the metadata as it is, the other tensors' infos and data at new offsets (each padded to the
    file's alignment). Returns the names dropped. For test files, e.g. an MTP block without the
    tensors a stock load would not count."""
    import struct

    from ..planning.index import _read_header, align_up

    header = _read_header(Path(src))
    kept, dropped = [], []
    for t in header.tensors:
        (dropped if drop(t.name) else kept).append(t)
    with open(src, "rb") as f, open(dst, "wb") as out:
        head = f.read(header.info_offset)
        out.write(head[:8] + struct.pack("<Q", len(kept)) + head[16:])  # magic, version | count | n_kv, metadata
        offset = 0
        for t in kept:
            name = t.name.encode()
            out.write(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape)))
            out.write(b"".join(struct.pack("<q", ne) for ne in t.shape) + struct.pack("<IQ", t.type_id, offset))
            offset += align_up(t.nbytes, header.alignment)
        out.write(b"\0" * (align_up(out.tell(), header.alignment) - out.tell()))
        for t in kept:
            f.seek(header.data_offset + t.rel_offset)
            out.write(f.read(t.nbytes) + b"\0" * (align_up(t.nbytes, header.alignment) - t.nbytes))
    return [t.name for t in dropped]
