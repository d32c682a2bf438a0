import sys

from taskledger.service.cli.main import main

sys.exit(main())
