"""The ``two_hosts`` fixture: hostA and hostB on this machine (``scripts/two-hosts``).

Skipped, with the reason, where they cannot be made (not root, no ``ip``/``unshare``, or
``ip netns add`` refused, as in most containers). The namespaces are deleted, and every process
left in them killed, when the module's tests are done, whatever happened.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from ._hosts import TwoHosts, why_not_possible

_pairs = itertools.count()


@pytest.fixture(scope="module")
def two_hosts(request: pytest.FixtureRequest) -> Iterator[TwoHosts]:
    reason = why_not_possible()
    if reason is not None:
        pytest.skip(f"two hosts on one machine: {reason}")
    hosts = TwoHosts(f"t{os.getpid()}x{next(_pairs)}")  # unique: test runs may overlap
    request.addfinalizer(hosts.down)  # first: even a half-made pair is removed
    try:
        hosts.up()
    except RuntimeError as exc:
        pytest.skip(f"two hosts on one machine: {exc}")
    yield hosts
