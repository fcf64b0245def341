import sys

from parascan.cli import main

sys.exit(main())
