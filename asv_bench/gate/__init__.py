"""The gate's own benchmark directory: asv imports every module of a benchmark directory,
and one that does not import (a benchmark of something newer than a compared commit) would stop
the gate. gate.py is a link to benchmarks/gate.py, so the full suite runs it too."""
