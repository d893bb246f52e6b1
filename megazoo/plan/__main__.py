"""`python -m megazoo.plan`: see megazoo/plan/cli.py."""
from .cli import main

raise SystemExit(main())
