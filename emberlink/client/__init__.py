"""emberlink.client: what a script touches (Device, Tensor, autograd, executors); never nn or optim."""
