"""``python -m fleethealth``: the same as the ``fleethealth`` command."""

import sys

from fleethealth.commands import main

sys.exit(main())
