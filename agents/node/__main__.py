import logging
import os

from .agent import main

code = main()
# Leave now: a worker thread still inside a torch.distributed wait (its peer died and Gloo's timeout is long)
# must not keep the process alive at the interpreter's exit, which joins every pool thread.
logging.shutdown()
os._exit(code)
