"""``python -m sa_outbox`` — the same CLI as the ``sa-outbox`` console script."""

from .cli import main

raise SystemExit(main())
