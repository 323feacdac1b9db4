"""What a replica is made of, as rules every executor calls: scheduling (``scheduling``:
the step plan, queue disciplines, policies) and KV memory (``kv``: block arithmetic,
block managers with prefix caching, admission, growth and preemption rules)."""
