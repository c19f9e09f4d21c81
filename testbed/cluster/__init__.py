"""The emulated cluster: fabric.py (controller + Mininet fabric), agent_pool.py (one long-lived agent per
server on it), probes.py (probe streams and iperf3 transfers across it)."""
