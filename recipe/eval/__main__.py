"""``python -m recipe.eval {generate,score} ...`` (see :mod:`recipe.eval.cli`)."""

import sys

from recipe.eval.cli import main

sys.exit(main())
