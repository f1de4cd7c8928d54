import sys

from benchmarks.suite.command import main

sys.exit(main())
