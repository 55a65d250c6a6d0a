"""Models, built from a name and the data set's shape."""

from medpfl.models.cnn import CNN4, build_model

__all__ = ["CNN4", "build_model"]
