"""`lab` with the test-only ping instrument, whose boot of slot 1 (A1) is first given the port named
in LAB_TEST_TAKEN_PORT: the race between the lab picking a free port and the engine listening on
it, lost for certain, for tests/faults/test_engine_faults.py."""

import os
import sys

from lab.instruments import REGISTRY
from tests.lab.ping_instrument import PingInstrument

REGISTRY[PingInstrument.name] = PingInstrument  # before lab.ladder.ladder builds the instruments schema

from lab.cli import main  # noqa: E402
from lab.runner import boot  # noqa: E402

_free_port = boot.free_port
_picks = [_free_port(), int(os.environ["LAB_TEST_TAKEN_PORT"])]  # slot 0, then slot 1's first boot
boot.free_port = lambda ports=None: _picks.pop(0) if _picks else _free_port(ports)

sys.exit(main())
