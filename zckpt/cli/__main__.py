"""``python -m zckpt.cli``: the ``zckpt`` program without its console script."""

import sys

from zckpt.cli.main import run

sys.exit(run())
