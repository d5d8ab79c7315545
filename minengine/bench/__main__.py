"""`python -m minengine.bench`: the benchmark's command line (`cli.main`)."""

import sys

from minengine.bench.cli import main

sys.exit(main())
