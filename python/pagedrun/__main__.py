"""`python -m pagedrun` is the `paged-run` CLI."""
from pagedrun.server.cli import main

raise SystemExit(main())
