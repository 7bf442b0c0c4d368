"""``fsdp train`` whose replica 0, from step ``FT_HOLD_AT`` on, waits before each step without
replica 1 until replica 1 has asked to be admitted to its next quorum (``FT_HOLD_MAX_S``
seconds at most in all).

torchrun runs this file instead of ``-m fsdp``. The tiny model trains 100 steps faster than a
restarted replica group starts on two busy cores, so the survivor would finish before the other
host could rejoin. It holds between two steps, before `FaultTolerantReplicate.start_step`, until
the store holds replica 1's registration for the round it is about to join (its heartbeat
beating meanwhile), so nothing of the protocol is changed; where the other host is back before
the step, nothing waits.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def _install() -> None:
    from fsdp_comm._ft_replicate import FaultTolerantReplicate

    hold_at = os.environ.get("FT_HOLD_AT")
    if not hold_at or os.environ.get("FSDP_FT_REPLICA") != "0":
        return
    longest = float(os.environ.get("FT_HOLD_MAX_S", "180"))
    start_step = FaultTolerantReplicate.start_step
    deadline: float | None = None

    def holding_start_step(self: FaultTolerantReplicate) -> Any:
        # From step FT_HOLD_AT on, every step waits while replica 1 is not in the quorum for
        # replica 1 to ask for the next one: one that asked and then failed (its round broke,
        # its ranks died and were restarted) is waited for again.
        nonlocal deadline
        if self.step >= int(hold_at) and 1 not in self.ranks:
            if deadline is None:
                deadline = time.monotonic() + longest
            key = f"q/{self._round}/m/1"  # replica 1 registered for this round
            while not self._store.check([key]) and time.monotonic() < deadline:
                time.sleep(0.02)
        return start_step(self)

    FaultTolerantReplicate.start_step = holding_start_step  # type: ignore[method-assign]


if __name__ == "__main__":
    _install()
    from fsdp._cli import main

    sys.exit(main(sys.argv[1:]))
