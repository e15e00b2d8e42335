"""Running quantized checkpoints: quantized linear modules, the loader and a generate loop."""
