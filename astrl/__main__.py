import sys

from astrl.cli import main

sys.exit(main())
