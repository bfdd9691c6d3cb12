"""DeepInfer's backend contract: Device, Communicator, Kernels, Backend, KVConnector and the op specs."""

from .backend import Backend
from .communicator import Communicator, DispatchHandle, DispatchResult
from .device import Device, DeviceCapabilities, HostEvent, HostStream, host_stream_context, record_stream_graph
from .errors import NotSupportedError
from .kernels import Kernels
from .kv_connector import KVConnector, KVConnectorError
from .kv_format import KVFormat
from .packed_pool import PackedPool, PackedRegion
from .quant import QuantizedWeight
from .version import INTERFACE_VERSION

__all__ = [
    "INTERFACE_VERSION",
    "Backend",
    "Communicator",
    "Device",
    "DeviceCapabilities",
    "DispatchHandle",
    "DispatchResult",
    "HostEvent",
    "HostStream",
    "KVConnector",
    "KVConnectorError",
    "KVFormat",
    "Kernels",
    "NotSupportedError",
    "PackedPool",
    "PackedRegion",
    "QuantizedWeight",
    "host_stream_context",
    "record_stream_graph",
]
