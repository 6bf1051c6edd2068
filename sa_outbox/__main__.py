"""``python -m sa_outbox`` — the same CLI as the ``sa-outbox`` console script.

Signal handlers go in first, before the heavy imports: a SIGTERM/SIGINT that arrives during start-up is
remembered and leads to a clean exit 0 instead of an abrupt death.
"""

import signal
import sys

_early: list[int] = []


def _remember(signum: int, frame: object) -> None:
    _early.append(signum)


for _sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(_sig, _remember)

from sa_outbox._cli import main  # noqa: E402

sys.exit(main(early_signals=_early))
