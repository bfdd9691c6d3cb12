"""The Huawei Ascend backend: torch_npu device, HCCL communicator, fused NPU ops and Triton-Ascend kernels.

Importing this package never imports torch_npu.
"""
