import sys

from ae.diagnose.cli import main

sys.exit(main())
