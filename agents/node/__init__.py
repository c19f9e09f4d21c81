"""The GPU-node agent process (torch allowed only in this package): RPC server, engine loop, collectives,
token streaming and migration. ``python -m agents.node --config FILE`` runs one."""
