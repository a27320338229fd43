"""The ``fleetwire`` command line: the one part of the repository that may import every other part.

* main: the parser, the client commands, and :func:`main` (the console script
  ``fleetwire.cli:main``, re-exported here); serve: the coordinator's flags and settings, and the
  start of a coordinator or a worker; up: ``fleetwire up`` (a coordinator and local workers);
* cluster, ops, progress, safety, security, shards, store: commands and flags by concern;
* console: what the client commands print; logs: the logging set-up of every process;
* reference: docs/OPERATIONS.md's configuration reference, generated from the parser.

The SDK (the rest of ``fleetwire/``) never imports this package (tests/unit/test_layers.py).
Import a module's names from the module (``from fleetwire.cli.main import build_parser``): the
package's ``main`` attribute is the function.
"""

from fleetwire.cli.main import main

__all__ = ["main"]
