"""The cache manager: host swap space for KV blocks and KV transfer between instances."""
