"""Export to ONNX per layer group, the onnxruntime backend and the TensorRT build profile (seed 004 §3.1).

- :mod:`laserlm.export.graphs`: the torch modules exported (embedding, one per layer group, bridges, heads);
- :mod:`laserlm.export.onnx`: :func:`export_onnx` writes the graphs and ``manifest.json``;
- :mod:`laserlm.export.ort_backend`: :class:`OnnxModel` / :class:`OnnxDecoder`, full and adaptive depth on onnxruntime;
- :mod:`laserlm.export.tensorrt`: the ``trtexec`` build profile (written, not built: no GPU here);
- :mod:`laserlm.export.cli`: ``laserlm export onnx``.
"""
