"""`python -m jax_kvoffload` runs the command line."""

import sys

from jax_kvoffload.cli import main

sys.exit(main())
