"""A signal trap for tests/test_supervisor.py, loaded only by the processes it starts (through PYTHONPATH).

``SA_OUTBOX_TEST_TRAP=WHERE:MODULE:WHO`` sends a SIGTERM at the moment MODULE starts being imported, so that a
test can land a signal at an exact point of start-up instead of guessing a delay:

* WHERE: ``main`` (the process started by the test) or ``child`` (a ``--processes`` child: a multiprocessing
  spawn child, recognised by ``--multiprocessing-fork`` on its command line);
* WHO: ``self``, ``parent`` (this process's parent) or ``group`` (the whole process group, the way
  ``systemctl stop`` or a terminal's Ctrl-C signals a service and all its children at once).

It fires once per process and writes ``trap fired`` to stderr, so that a test can check it really fired.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

_spec = os.environ.get("SA_OUTBOX_TEST_TRAP", "")


class _Trap:
    def __init__(self, module: str, who: str) -> None:
        self.module = module
        self.who = who

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        sys.stderr.write(f"trap fired: SIGTERM to {self.who} on import of {name} in pid {os.getpid()}\n")
        sys.stderr.flush()
        if self.who == "group":
            os.killpg(os.getpgrp(), signal.SIGTERM)
        else:
            os.kill(os.getppid() if self.who == "parent" else os.getpid(), signal.SIGTERM)
        return None


if _spec:
    _where, _module, _who = _spec.split(":")
    _is_child = "--multiprocessing-fork" in sys.argv
    if _is_child == (_where == "child"):
        sys.meta_path.insert(0, _Trap(_module, _who))
