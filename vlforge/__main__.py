import sys

from vlforge.cli import main

if __name__ == "__main__":  # not when a spawned process (multiprocessing) imports the main module again
    sys.exit(main())
