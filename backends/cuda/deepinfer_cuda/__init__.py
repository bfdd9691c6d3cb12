"""The NVIDIA backend: torch.cuda device, NCCL communicator, Triton kernels."""
