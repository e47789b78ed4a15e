"""Time-to-first-token for prompts whose prefix is in the context store (SparKV).

Per (token chunk, layer) the KV is either loaded from the store (I/O thread) or computed
(compute thread), both running at once under the Transformer's dependencies.  ``grid``
says what depends on what, ``plan`` decides which path takes each chunk, ``costs`` predicts
what each costs, ``compute`` runs the model on a chunk, ``executor`` runs a plan.
"""
