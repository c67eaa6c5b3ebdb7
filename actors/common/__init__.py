"""What every role and every folder of ``actors`` shares: the messages and specs that cross
(``protocol``), errors that name the role that failed (``errors``), flat shared-memory buffers
and the waits on their counters (``buffers``, ``seqwait``), how parameters are spread over
servers (``slicing``) and the GPU side of a role (``device``). Imports nothing else of
``actors``."""
