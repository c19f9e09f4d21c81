"""Published policies written only through the plug-in interfaces (testbed.orchestrator.interfaces), one file
each, outside the core packages: what a researcher's own policy looks like (docs/plugins.md)."""
