"""A synchronous group summed by hosts (``topology.reduce: hosts``): the stub's side of its
steps (``stub_side``), a block's sum on its way to the servers (``worker_side``), and a
server's update taken in part by part (``server_side``). Each reads its role through a
``Protocol`` of the role's public names, declared here: the roles import this folder, never
the other way round. Builds on ``memory``, ``exchange`` and ``common``."""
