"""``python -m scheduler_extender.simulator MODE …`` (same as ``accelstack simulate MODE …``)."""

import sys

from .cli import main

sys.exit(main())
