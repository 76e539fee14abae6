"""`python -m tokenprobe`: the tokenprobe command."""

from .cli.main import main

raise SystemExit(main())
