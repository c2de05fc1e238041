"""Client subcommands of `sigmaflight`: submit, status, list, cancel, pull, inspect, plot, models.

Each talks to a running server through `sigmaflight.client.Client` (`--url`, default
http://127.0.0.1:8000 or SIGMAFLIGHT_URL; `--token` or SIGMAFLIGHT_TOKEN), or reads an
`.arrow` file. JSON goes to stdout (`list` and `models` print a table instead when stdout is a
terminal), progress and errors to stderr; the exit status is 0 on success, 1 when the server or
the data said no, 2 for bad usage.

One module per topic, each with its subcommands' flags and their `run_*`: submit.py (the request
flags, one per RolloutRequest field), rollouts.py (status, list, cancel, models), pull.py (a
trajectory into an .arrow file), inspect.py (inspect, plot); common.py holds what they share
(the connection flags, printing, `rollout_ref`) and parser.py puts them in one parser and maps
errors to exit statuses.
"""
