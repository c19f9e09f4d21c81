"""The compute orchestrator's pure parts: length forecasts (forecast.py), the planner and the balancer.

Pure (DESIGN.md floors): numpy, scipy and statsmodels only; no mininet, os_ken, torch, zmq or sockets.
"""
