"""`python -m naflexclip ...` runs the CLI."""

import sys

from naflexclip.cli import main

sys.exit(main())
