"""Tools that drive real vLLM engines and servers: the demo, the scenario runner, tiny models,
workloads, the chat load generator, the LMCache contender."""
