"""Models, built from a params name (``train.model``), its arguments (``train.model_args``) and
the data set's sample shape. The zoo and the contract its models meet: :mod:`medpfl.models.zoo`."""

from medpfl.models.cnn import CNN4
from medpfl.models.linear import MLP, MLR
from medpfl.models.resnet import ResNet
from medpfl.models.zoo import MODEL_NAMES, ZOO, build_model, check_model_name, resolve_model_args

__all__ = ["CNN4", "MLP", "MLR", "MODEL_NAMES", "ResNet", "ZOO", "build_model", "check_model_name", "resolve_model_args"]
