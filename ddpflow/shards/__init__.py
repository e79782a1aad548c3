"""Fixed-size-record shards in the artifact store, and ranks that stream them.

A dataset too large to hold in every rank is formatted once into shards (`shard_file`),
listed by an index file (`index`); each rank reads only the shards its batches need, a
bounded number at a time (`stream`), in an order that depends on the seed and the epoch,
never on the world size (`order`).
"""
