"""Memory, disk and CPU: what a stage needs for a model's shape, what the machine has, published shapes."""
