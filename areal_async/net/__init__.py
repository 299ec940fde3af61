"""The ground floor: typed RPC frames, the trainer-rank registry, this host's routable address, and the private
c10d group a trainer forms with servers. Imports nothing above it."""
