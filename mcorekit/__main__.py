import sys

from mcorekit.cli import main

sys.exit(main())
