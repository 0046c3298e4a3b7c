import sys

from core.cli import main

if __name__ == "__main__":  # spawned tensor-parallel ranks import this module as __mp_main__
    sys.exit(main())
