"""Exit codes of `python -m trainers.train`, so the launcher side knows whether a relaunch can help.

Codes follow sysexits where one fits. A process killed by a signal (negative code from
Popen, or 128+N from a shell) is treated as retryable by the launcher side.
"""

OK = 0
# Bad job spec, bad data reference, unusable checkpoint policy: relaunching cannot fix it.
CONFIG_ERROR = 78  # EX_CONFIG
# The loss went NaN/inf and could not be recovered by rolling back.
DIVERGED = 65  # EX_DATAERR
# A peer vanished, a collective timed out, storage hiccuped: resume from the last checkpoint.
RETRYABLE_FAILURE = 75  # EX_TEMPFAIL

FATAL = frozenset({CONFIG_ERROR, DIVERGED})
RETRYABLE = frozenset({RETRYABLE_FAILURE})
