"""The zoo audit: every architecture transformers 5.22.2 and multimolecule 0.2.2 ship, scanned in every
environment for module names that collide with an envoy's, and whether its envoy tree survives nnsight's
serializer.

Modules, and where each runs:

- ``scan`` (host, stdlib only): ``python3 -m nnsight_repro zoo``; runs the worker in each environment and
  writes the report;
- ``worker`` (inside an environment): scans catalog units one at a time, one record each, through
  :mod:`nnsight_repro.channel`;
- ``catalog`` (inside an environment): what is scanned, read from transformers' and multimolecule's Auto mappings;
- ``build`` (inside an environment): one unit's model from its config's defaults, on meta or tiny on the CPU;
- ``minimal_trees`` (inside an environment): the two-module trees behind the zoo's findings beyond ``output``;
- ``report`` (host, stdlib only): from the raw scans to ``results/zoo/zoo.json`` and ``zoo.md``.

Importing this package imports nothing.
"""
