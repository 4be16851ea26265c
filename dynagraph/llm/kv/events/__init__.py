"""KV events for the Router: an engine's block stores and removals as the Router's index sees them."""
