"""Export to ONNX per layer group and the TensorRT build profile (seed 004 §3.1); the export runs on the onnxruntime
engine of the runtime (:mod:`laserlm.runtime.ort_engine`, ``laserlm.load(export_dir)``).

- :mod:`laserlm.export.graphs`: the torch modules exported (embedding, one per layer group, bridges, heads);
- :mod:`laserlm.export.onnx`: :func:`export_onnx` writes the graphs and ``manifest.json``;
- :mod:`laserlm.export.tensorrt`: the ``trtexec`` build profile (written, not built: no GPU here);
- :mod:`laserlm.export.cli`: ``laserlm export onnx``.
"""
