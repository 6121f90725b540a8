"""`python -m ember`: the `ember` command."""

from ember.cli import main

raise SystemExit(main())
