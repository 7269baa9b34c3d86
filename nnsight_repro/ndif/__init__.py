"""Local NDIF stacks: the real NDIF server on loopback, brought up and torn down by the project.

Two stack generations: PyPI ``ndif`` 0.1.2, which serves nnsight 0.8 clients (the default), and PyPI
``ndif`` 0.0.1 plus backports, which serves nnsight 0.7.0 clients (``line="0.7"``, stock or patched
nnsight on the server). Each runs inside its own private network namespace that has only ``lo``, so
nothing it opens is reachable from outside and its fixed ports (Ray's above all) cannot collide with
anything else on the machine.

Modules, one concept each:

- ``server_env``: the cached venv each generation's server runs in (and the Debian ``redis-server`` it needs);
- ``server_packages``: extras (``--with multimolecule``): the packages an extra adds to a server environment,
  and where its server processes import them;
- ``built_log``: what the model actors built, one JSON line per load (written in the server, read by ``stack_clients``);
- ``netns``: the network namespace: create, run inside, list and kill its processes, delete;
- ``memcg``: the stack's memory cgroup: where its memory is counted, optionally capped, and OOM kills show;
- ``generations``: one class per server generation (everything in which they differ), and ``PAIRINGS``: which
  client environment runs against which generation and server build, declared once;
- ``config``: a stack's folders, ports, settings and their checks (``StackConfig``);
- ``adaptations_0_1_2``: the only code that runs *inside* the 0.1.2 server: the CPU model actor and the
  nnsight-0.8.1 compatibility shim, each named for the incompatibility it bridges;
- ``adaptations_0_0_1``: the same for the 0.0.1 server: every backport that lets it serve nnsight 0.7.0;
- ``deploy``: which panel models a stack serves, under which model keys, and the deploy file;
- ``errors``: the stack's errors and its progress lines;
- ``stack_state``: a stack folder's state file, the lock on ``up``/``down``, and the lease of a longer use;
- ``health``: HTTP from inside the namespace, ``/status``, and ``status`` / ``healthy``;
- ``services``: the stack's processes, their logs, and the waits on them;
- ``memory_watch``: a stack that ran out of memory, named during every wait;
- ``stack``: ``up`` / ``down`` / ``ensure_up`` and deploying models;
- ``stack_clients``: running remote-client cases and Ray clients against a running stack;
- ``remote_client``: what a remote test runs, in a client environment of the stack's line inside the namespace;
- ``socket_race``: the one client-side transport fault a remote trace is sent again for, and the retry;
- ``negative_control``: every pairing of stock/patched nnsight 0.7.0 client and server on the 0.7 stack;
- ``panel``: every panel model traced remotely on each line's server with the multimolecule extra, as released or
  patched (``ndif panel``);
- ``probe``: a stdlib HTTP GET run inside the namespace (the host cannot reach its loopback);
- ``feasibility``: the probes of ``scripts/ndif_feasibility/probe_ndif.py``: declarations, runner, client;
- ``ray_clients``: Ray clients connecting to the stack's Ray as ndif's API does, run inside the namespace;
- ``cli``: ``nnsight-repro ndif up|down|status [--line 0.7] [--with multimolecule]``, ``negative-control`` and ``panel``.

Importing this package imports nothing: the adaptations modules are loaded in the server environment
(by Ray workers; 0.0.1's by every server process, through a generated ``sitecustomize``), everything
else runs under any Python with the standard library.
"""
