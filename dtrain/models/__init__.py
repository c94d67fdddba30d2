"""Networks the shipped recipes use."""
from dtrain.models.cifar10_convnet import ConvNetCIFAR10
from dtrain.models.digits_cnn import DigitsCNN
from dtrain.models.resnet import ResNet, ResNet50

__all__ = ["ConvNetCIFAR10", "DigitsCNN", "ResNet", "ResNet50"]
