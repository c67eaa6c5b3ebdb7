"""The distributed roles of raysinga as plain classes, made Ray actors at spawn time.

The roles stand at the top: ``ParamServer`` (``server.py``) owns parameter slices and their
optimizer state, ``Worker`` (``worker.py``) computes gradients of its part of a group's batch,
``Stub`` (``stub.py``) runs one group's steps; ``placement.py`` checks that a topology fits
the cluster and spawns them. Below them, each folder serves them with one concern, and
imports only the folders below it (``tests/test_structure.py`` holds them to it)::

    server.py  worker.py  stub.py  placement.py     the roles, and their placing
         |
    hostsum/     a group summed by hosts: the worker's, the stub's and the server's side
         |
    memory/      what a server keeps and hands out: checkpoint copies and shard, copies for
         |       a rebuild and the replay log, its values out and gradients in, and what a
         |       worker reads of them
    exchange/    what passes between roles: the per-step control path (doorbells), the
         |       run's epoch, bytes between hosts (TCP, the wire's formats, compression,
         |       mirrors) and the traffic they count
    common/      what all of them share: the messages and specs, errors that name a role,
                 shared-memory buffers and waits, slicing, the GPU side

Importing this package does not import Ray.
"""
