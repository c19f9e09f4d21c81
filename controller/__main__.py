"""``python -m controller``: run the OrchestrRL SDN controller (see controller.runtime)."""
import sys

from .runtime import main

sys.exit(main())
