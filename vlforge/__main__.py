import sys

from vlforge.cli import main

sys.exit(main())
