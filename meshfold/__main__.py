import sys

from meshfold.cli import main

sys.exit(main())
