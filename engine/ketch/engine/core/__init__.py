"""Engine core: requests, the paged KV block pool and the continuous-batching scheduler.

Nothing in this package touches tensors; it decides which tokens of which requests run in each
step and where their KV entries live.
"""
