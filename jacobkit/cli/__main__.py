import sys

from jacobkit.cli import main

sys.exit(main())
