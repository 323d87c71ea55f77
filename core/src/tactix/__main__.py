import sys

from tactix.cli import main

sys.exit(main())
