"""edgekv.evals: synthetic long-context retrieval tasks, the shipped fixture model and the quality harness."""
