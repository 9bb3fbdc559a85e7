#!/usr/bin/env python
"""Django's command-line utility for the pgqueue example shop.

python examples/django_project/manage.py demo     # the whole demo, one command
"""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
