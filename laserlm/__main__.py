"""``python -m laserlm ...``: the ``laserlm`` command line (:func:`laserlm.cli.main`)."""

import sys

from .cli import main

sys.exit(main())
