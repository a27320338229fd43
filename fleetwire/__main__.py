"""``python -m fleetwire`` runs the CLI."""

import sys

from fleetwire.cli import main

sys.exit(main())
