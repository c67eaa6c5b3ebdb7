"""What passes between roles: the per-step control path within a node (``doorbell``, a
group's ``bells``), the run's epoch that fences a replaced role (``fence``), bytes between
hosts over connections of their own (``tcp``), what they cross as (``wire``, ``squeeze``),
a node's mirrors of the servers' values (``mirrors``), and the bytes a step moves by route
(``traffic``). Builds on ``common`` only."""
