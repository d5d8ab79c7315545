import sys

from reqscope.cli import main

sys.exit(main())
