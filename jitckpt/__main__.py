import sys

from jitckpt.cli import main

sys.exit(main())
