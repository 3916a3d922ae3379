"""The sharded optimizer: per-piece views of the user's optimizer, clipping, loss scaling."""
