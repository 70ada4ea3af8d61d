"""The MLflow model registry: versions, aliases, promotion, rollback, and a version's scorecard."""
