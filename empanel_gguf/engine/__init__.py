"""The native seam and what runs on it: our libraries found, checked and opened (native), the
llama.cpp they are built from (pins), the header's declarations read as data (header), the slot
pools (pools), their counters (stats) and RPC hosts (rpc).

Planning may read the declarations (pins, header, stats), which load no library; nothing here
imports the faces (llama, server, commands, cli) or the lab. This file imports nothing, so that
the build can read pins.py by path and planning can import a declaration without the seam.
"""
