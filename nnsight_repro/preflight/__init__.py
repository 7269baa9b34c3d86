"""``preflight``: will a checkpoint run remotely through nnsight, per client (stock 0.7.0, fixed 0.7.0,
0.8.1), and what to change if not; read off its config alone, and the host's ``/env`` and ``/status``.

Modules, and where each runs:

- ``checkpoint`` (host, stdlib): where MODEL's config.json is, offline; bad input;
- ``server`` (host, stdlib): what an NDIF host says about itself (``/status``, ``/env``);
- ``tree`` (inside an environment, one per nnsight line): the module tree built on the meta device, and
  what that line's nnsight makes of it;
- ``assess`` (host, stdlib): the key each client sends, what a server builds from it, and the verdicts, by
  the rule in :mod:`nnsight_repro.outcomes` (the one ``ndif panel`` predicts with);
- ``cli``: the command, its text and JSON output and its exit codes.

Importing this package imports nothing.
"""
