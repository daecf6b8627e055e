"""Planning: pure Python over the model's header and our cache files, no library loaded.

index (the GGUF's routed experts), sizing (slots per layer), estimate and guard (memory),
host_memory, plan (one load's plan: plan_load), plan_file (the plan written down for C), profile
(warm-start profiles), cache and digests (files cached by identity), format (byte sizes).

Planning stands below the engine and the faces: it imports neither (only the engine's
declarations, engine.pins and engine.header, which load nothing), nor the lab. This file imports
nothing.
"""
