"""``python -m fsdp``: the ``fsdp`` command, for hosts where the console script is not on PATH
(``torchrun ... -m fsdp train``)."""

import sys

from fsdp._cli import main

sys.exit(main())
