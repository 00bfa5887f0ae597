"""lightning-gossip."""
