"""Which routed-expert tensors of well-known MoE models let O_DIRECT reads land in place.

A read lands in a plain pool's slot uncopied when every expert of the tensor sits at one offset
modulo the O_DIRECT block (csrc/reader.c), that is when one expert's bytes (its stride) are a
multiple of the block: GGUF writers store a 3-D expert tensor contiguously, expert e at
offset + e * stride. The stride follows from the shape and the type alone, so this table needs
no download:

    python scripts/read_layouts.py            # markdown table, as in docs/performance.md

For a file at hand, `empanel-gguf inspect MODEL.gguf` counts its own tensors.
"""

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from empanel_gguf.abi.header import READ_ALIGN

# (model, n_embd, expert hidden size): every routed expert matrix is n_embd x ff (gate, up) or
# ff x n_embd (down), so both have n_embd * ff weights; from the models' published configs
MODELS = (
    ("Qwen3-30B-A3B", 2048, 768),
    ("Qwen3-235B-A22B", 4096, 1536),
    ("Qwen3-Coder-480B-A35B", 6144, 2560),
    ("Mixtral-8x7B", 4096, 14336),
    ("DeepSeek-V3 / R1, Kimi-K2", 7168, 2048),
    ("GLM-4.5-Air", 4096, 1408),
    ("Llama-4-Scout", 5120, 8192),
    ("OLMoE-1B-7B", 2048, 1024),
    ("gpt-oss-20b / 120b", 2880, 2880),
)
TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "IQ4_XS", "Q3_K", "Q2_K", "MXFP4")


def expert_stride(n_weights: int, type_name: str) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return n_weights // block * size


def main() -> None:
    print("| model | " + " | ".join(TYPES) + " |")
    print("| --- | " + " | ".join("---" for _ in TYPES) + " |")
    for name, n_embd, ff in MODELS:
        cells = []
        for t in TYPES:
            block = GGML_QUANT_SIZES[GGMLQuantizationType[t]][0]
            if n_embd % block or ff % block:  # rows (of either matrix) must be whole blocks: no such GGUF
                cells.append("n/a")
                continue
            cells.append("yes" if expert_stride(n_embd * ff, t) % READ_ALIGN == 0 else "no")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
