"""The native seam and what runs on it: our libraries found, checked and opened (native), the
slot pools (pools), their counters (stats) and RPC hosts (rpc).

The engine stands on planning (a load's plan, plan_file) and abi (the header's declarations and
the pins); nothing here imports the faces (llama, server, commands, cli), the lab or the writers.
This file imports nothing.
"""
