"""`python -m reqscope.bench`: the benchmark's command line (`cli.main`)."""

import sys

from reqscope.bench.cli import main

sys.exit(main())
