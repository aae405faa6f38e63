"""`python -m hf_ssd.cli ...` is the same as the `hf-ssd` command."""

import sys

from . import main

sys.exit(main())
