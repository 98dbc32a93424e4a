"""One module per added eviction policy; each is imported (and so registered) with ``kvlab.policy.evict``."""
