"""`python -m hybridserve ...` is the `hybridserve` command."""
import sys

from hybridserve.cli import main

sys.exit(main())
