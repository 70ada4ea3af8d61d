"""One forward step on ONNX Runtime: what the engine asks of a runner (protocol.py), the two runners (standard.py;
gqa.py, in-place K/V rows), and the session factory (onnx_session.py, onnx_external.py for graphs past 2 GB)."""
