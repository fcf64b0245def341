import sys

from parascan.tools.cli import main

sys.exit(main())
