"""The NDIF feasibility probes: can the panel run on a live NDIF host, per pairing (client x server)?

- ``declarations`` (host, stdlib only): the pairings probed, the probe file's schema and validation,
  and matching an observation against a probe's expectation;
- ``runner`` (host, stdlib only): brings the local stacks up as needed, runs each pairing's probes
  through the client, compares, and writes ``results/ndif_feasibility/``; its command line is
  ``scripts/ndif_feasibility/probe_ndif.py``;
- ``client`` (inside a client environment, in the stack's namespace): runs the probes with that
  environment's nnsight and sends one event per step through :mod:`nnsight_repro.channel`.

The probes themselves are data: ``scripts/ndif_feasibility/probes.toml``.
"""
