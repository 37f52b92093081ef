"""`lab` with the test-only `ping` instrument registered, for runs started as subprocesses."""

import sys

from lab.instruments import REGISTRY
from tests.lab.ping_instrument import PingInstrument

REGISTRY[PingInstrument.name] = PingInstrument  # before lab.ladder.ladder builds the instruments schema

from lab.cli import main  # noqa: E402

sys.exit(main())
