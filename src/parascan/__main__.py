import sys

from parascan.cli.main import main

sys.exit(main())
