"""Evaluations of a model: zero-shot classification on an ImageFolder (`zero_shot`), CLIP_benchmark's tasks
(`benchmark_tasks`) and the dense-feature probe (`dense_probe`)."""
