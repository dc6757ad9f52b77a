import sys

from npuprep.cli.main import main

sys.exit(main())
