"""``python -m proxykv_hf.cli`` (and ``torchrun -m proxykv_hf.cli``): the ``proxykv`` command."""

import sys

from .commands import main

sys.exit(main())
