"""How clients call a model: the OpenAI-compatible HTTP app (app.py and its routes, schemas, streaming, result
cache and metrics), a uvicorn server in a thread (background.py), and every version as an MLflow pyfunc model."""
