"""``python -m fsdp_ckpt inspect|verify|export|from-dcp ...``"""

import sys

from .cli import main

sys.exit(main())
