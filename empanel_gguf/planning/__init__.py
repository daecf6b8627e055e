"""Planning: pure Python over the model's header and our cache files, no library loaded.

index (the GGUF's routed experts), sizing (slots per layer), estimate and guard (memory),
host_memory, options (the MoE options, declared once), plan (one load's plan: plan_load),
plan_file (the plan written down for C), profile (warm-start profiles), cache and digests (files
cached by identity), format (byte sizes).

Planning stands below the engine and the faces: it imports neither, nor the lab; only abi (the
header's declarations and the pins, which load nothing). This file imports nothing.
"""
