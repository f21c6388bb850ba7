"""The layer math in PyTorch: config, the layer table, weights and state, the ops, sampling."""
