"""The persistent context store: a context's KV saved once, reused across requests, restarts and devices."""
