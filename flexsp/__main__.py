import sys

from flexsp.cli import main

sys.exit(main())
