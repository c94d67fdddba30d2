"""Networks the shipped recipes use."""
from dtrain.models.cifar10_convnet import ConvNetCIFAR10
from dtrain.models.digits_cnn import DigitsCNN

__all__ = ["ConvNetCIFAR10", "DigitsCNN"]
