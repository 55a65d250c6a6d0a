"""medpfl: reproducible federated and personalized federated learning benchmarks on medical images."""

__version__ = "0.1.0"
