"""Cluster backends behind one interface (base.Backend): ``emulated`` (real agents, fabric and controller)
and ``simulated`` (the same engine in virtual time, RLSim's network)."""
