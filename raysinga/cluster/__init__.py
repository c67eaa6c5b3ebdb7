"""The Ray cluster a run uses: raysinga's own code shipped to its nodes, a check that every
node can run the roles and sees the run's storage and data (:mod:`.reach`), and multi-node
clusters on one machine for demos, benchmarks and tests."""
