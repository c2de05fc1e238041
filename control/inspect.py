"""Temporary alias of sigmaflight.report for control/plot.py only (it imports `control.inspect`).

Delete this file when the `plots` rewrite (sigmaflight/plot.py) replaces control/plot.py.
"""

from sigmaflight.report import *  # noqa: F401,F403
from sigmaflight.report import Report  # noqa: F401
