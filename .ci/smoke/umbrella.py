"""fsdp installed alone (with its four packages): the command answers and plans."""
import json
import subprocess
import sys

import fsdp

version = subprocess.run([sys.executable, "-m", "fsdp", "--version"], check=True,
                         capture_output=True, text=True).stdout
assert "fsdp-ckpt" in version, version
plan = subprocess.run(["fsdp", "plan", "--model", "small", "--gpus", "2", "--json"],
                      check=True, capture_output=True, text=True).stdout
assert json.loads(plan)["memory"], plan
print("fsdp", fsdp.__version__, "ok")
