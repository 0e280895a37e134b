"""emberlink.client: what a script touches (Device, Tensor, autograd, nn, optim, executors)."""
