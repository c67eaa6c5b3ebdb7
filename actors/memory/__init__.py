"""What a server keeps and hands out: its checkpoint copies and their background writes
(``snapshots``, ``shard``), its copies for a rebuild and the replay log of the gradients
applied since (``copies``, ``replay``), where its values go (``values_out``) and where its
gradient comes from (``grads_in``); and what a worker reads of the servers' values
(``param_reader``). Builds on ``exchange`` and ``common``."""
