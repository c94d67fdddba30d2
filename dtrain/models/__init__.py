"""Networks the shipped recipes use."""
from dtrain.models.char_transformer import CharTransformer
from dtrain.models.cifar10_convnet import ConvNetCIFAR10
from dtrain.models.digits_cnn import DigitsCNN
from dtrain.models.resnet import ResNet, ResNet50
from dtrain.models.seq2seq_transformer import Seq2SeqTransformer

__all__ = ["CharTransformer", "ConvNetCIFAR10", "DigitsCNN", "ResNet", "ResNet50", "Seq2SeqTransformer"]
