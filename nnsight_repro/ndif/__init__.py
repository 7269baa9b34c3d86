"""Local NDIF stacks: the real NDIF server on loopback, brought up and torn down by the project.

One stack generation so far: PyPI ``ndif`` 0.1.2, which serves nnsight 0.8 clients. It runs inside a
private network namespace that has only ``lo``, so nothing it opens is reachable from outside and its
fixed ports (Ray's above all) cannot collide with anything else on the machine.

Modules, one concept each:

- ``server_env``: the cached venv the server runs in (and the Debian ``redis-server`` it needs);
- ``netns``: the network namespace: create, run inside, list and kill its processes, delete;
- ``config``: ports, folders and the environment every server process gets;
- ``adaptations_0_1_2``: the only code that runs *inside* the server: the CPU model actor and the
  nnsight-0.8.1 compatibility shim, each named for the incompatibility it bridges;
- ``deploy``: which panel models a stack serves, under which model keys, and the deploy file;
- ``stack``: ``up`` / ``down`` / ``status``;
- ``remote_client``: what a remote test runs, in the ``upstream-0.8`` environment inside the namespace;
- ``probe``: a stdlib HTTP GET run inside the namespace (the host cannot reach its loopback);
- ``cli``: ``nnsight-repro ndif up|down|status``.

Importing this package imports nothing: ``adaptations_0_1_2`` is loaded by Ray workers in the server
environment, everything else runs under any Python with the standard library.
"""
