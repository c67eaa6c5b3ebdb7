"""The distributed roles of raysinga as plain classes, made Ray actors at spawn time.

``ParamServer`` owns parameter slices and their optimizer state, ``Worker`` computes gradients of
its part of a group's batch, ``Stub`` runs one group's steps; ``Topology`` says how many of each
and what they need, ``cluster`` places them. Importing this package does not import Ray.
"""
