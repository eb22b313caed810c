"""Model backends. Only modules in this package import onnxruntime, torch or tensorrt, and lazily."""
