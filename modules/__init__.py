"""Example modules shipped with Asyncflow: resource (quota ledger), mysql (instances), monitor (events)."""
