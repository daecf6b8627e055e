"""The lab, beside the engine: routing traces (trace, recorder), their replay through cache
policies (replay, policies), the exactness check's run (exactness) and the benchmark (bench,
`empanel-gguf bench`).

The lab uses planning, the engine and the drop-in Llama; it imports none of the other faces
(server, commands, cli). This file imports nothing.
"""
