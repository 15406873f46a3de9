"""turnrl-npu-runtime: device detection, distributed backends, Ascend defaults, memory and process supervision."""

__version__ = "0.1.0"
