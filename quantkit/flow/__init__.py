"""The quantize flow: one job from a recipe and a model to a checkpoint (pipeline, onloading, resume, distributed calibration, the plan)."""
